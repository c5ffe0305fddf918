"""The profile JSON format across the CpuCorrections record: a profile written before the
corrections moved into ``Profile.cpu`` (flat top-level keys) loads with them and writes back
the same keys, in the same order; a profile with no corrections prices like a GPU one."""

import json

from pdserve.planner.cpu_corrections import CpuCorrections
from pdserve.planner.profile import Profile

# docs/results/planner/profile_cpu_smollm2_zen4_1205_pooled32.json at commit 99d0797, its
# tables cut to 2x2 and 3x2 (the decode row factors to the 3 rows kept) and its meta to 3 keys.
OLD_PROFILE = """{"prefill": {"rows": [16, 64], "cols": [0, 512], "seconds": [[0.04766801199730253,
 0.05318909600464394], [0.1736676200016518, 0.18761014800111298]]}, "decode": {"rows": [1, 2,
 4], "cols": [64, 256], "seconds": [[0.027163719249074347, 0.027163719249074347],
 [0.028429178873921046, 0.029466930998751195], [0.029694638498767745, 0.034151838000980206]]},
 "transfer_bytes": [5898240.0, 23592960.0, 47185920.0], "transfer_seconds":
 [0.026191536002443172, 0.03478305199678289, 0.0708047340012854], "router_overhead_s":
 0.003603519500757102, "kv_bytes_per_token": 46080, "num_layers": 30, "engine": {"model":
 "embedded", "block_size": 16, "num_blocks": 2048, "max_model_len": 2048,
 "max_num_batched_tokens": 512, "max_num_seqs": 64, "prefill_chunk_size": 0, "device": "cpu",
 "threads": 1, "weights": "fp32", "weight_group": 32, "kv_dtype": "fp32", "prefill_gemm":
 "auto", "activations": "int8", "load_format": "auto"}, "co_run_slowdown": 0.9132915107672255,
 "co_run_slowdown_prefill": 1.0460529620284378, "co_run_slowdown_decode_pair":
 0.9140799593625356, "co_run_slowdown_prefill_pair": 1.0, "co_run_fixed_s":
 0.0053238123507451844, "co_run_fixed_s_prefill": 0.03669926336447396,
 "co_run_fixed_s_local_prefill": 0.013904368082733426, "co_run_fixed_s_decode_pair":
 0.008598699377686038, "oversubscribed_prefill_weight": 1.0014711752094723,
 "prefill_worker_slowdown": 0.9902236625315253, "decode_worker_slowdown": 1.0000000000003382,
 "decode_row_factors": [0.9552666945542743, 1.0422694624903683, 1.093278873830897],
 "disaggregated_hop_s": 0.009972480499242903, "sample_seconds_per_row": 0.0010885456249987158,
 "router_cpu_per_request_s": 0.007516463759994487, "router_cpu_per_token_s":
 0.000484848703821521, "stream_cpu_per_token_s": 0.0001814516129032258, "meta": {"cpu":
 "AMD EPYC", "threads": 1, "model": "embedded"}, "version": 1}"""


def test_an_old_flat_profile_loads_its_corrections_and_round_trips_to_the_same_dict():
    old = json.loads(OLD_PROFILE)
    prof = Profile.from_dict(old)
    assert prof.cpu.co_run_slowdown == old["co_run_slowdown"]
    assert prof.cpu.co_run_fixed_s_local_prefill == old["co_run_fixed_s_local_prefill"]
    assert prof.cpu.decode_row_factors == tuple(old["decode_row_factors"])
    assert prof.cpu.disaggregated_hop_s == old["disaggregated_hop_s"]
    assert prof.cpu.router_cpu_per_request_s == old["router_cpu_per_request_s"]
    assert prof.sample_seconds_per_row == old["sample_seconds_per_row"]
    again = json.loads(json.dumps(prof.to_dict()))
    # Engine settings added since are written with their defaults (dtype: auto, which is fp32
    # on the CPU the profile was measured on); everything else comes back as it was.
    assert again["engine"] == {**old["engine"], "dtype": "auto"}
    assert {**again, "engine": old["engine"]} == old
    assert list(again) == list(old)  # the keys in the order profiles were always written


def test_a_profile_without_corrections_carries_the_neutral_record():
    old = json.loads(OLD_PROFILE)
    bare = {k: v for k, v in old.items() if k not in CpuCorrections.__dataclass_fields__}
    prof = Profile.from_dict(bare)
    assert prof.cpu == CpuCorrections()
    decode_only = prof.decode_seconds(2, 64)
    assert prof.cpu.decode_row_factors == () and decode_only == old["decode"]["seconds"][1][0]
    written = prof.to_dict()
    assert written["co_run_slowdown"] == 1.0 and written["co_run_slowdown_prefill"] is None
    assert set(written) == set(old)  # every key written, at its neutral value

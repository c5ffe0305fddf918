// Python bindings of the CPU extension. Every entry point releases the GIL: the workers' RPC
// threads keep streaming while a step computes.
#include "cpu_kernels.h"

#include <optional>

namespace py = pybind11;

namespace {

using MaybeTensor = std::optional<at::Tensor>;

// A projection from Python: (weight, bias, oneDNN-packed weight, skinny-packed weight); absent
// ones are None.
using LinearTuple = std::tuple<at::Tensor, MaybeTensor, MaybeTensor, MaybeTensor>;

StackLinear make_linear(const LinearTuple& t) {
  return StackLinear{std::get<0>(t), std::get<1>(t).value_or(at::Tensor()),
                     std::get<2>(t).value_or(at::Tensor()), std::get<3>(t).value_or(at::Tensor())};
}

// One layer from Python: (input_norm, post_norm, qkv, o, gate_up, down), each projection a
// LinearTuple.
using LayerTuple = std::tuple<at::Tensor, at::Tensor, LinearTuple, LinearTuple, LinearTuple, LinearTuple>;

std::unique_ptr<DecoderStack> make_stack(const std::vector<LayerTuple>& layers, int64_t num_heads,
                                         int64_t num_kv_heads, int64_t head_dim, double eps,
                                         int64_t min_packed_rows, int64_t max_skinny_rows) {
  std::vector<StackLayer> out;
  for (const auto& t : layers) {
    out.push_back(StackLayer{std::get<0>(t), std::get<1>(t), make_linear(std::get<2>(t)),
                             make_linear(std::get<3>(t)), make_linear(std::get<4>(t)),
                             make_linear(std::get<5>(t))});
  }
  return std::make_unique<DecoderStack>(std::move(out), num_heads, num_kv_heads, head_dim, eps,
                                        min_packed_rows, max_skinny_rows);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (fp32, CPU)", release());
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8,
        "decode attention over an int8 paged KV cache (codes + a scale per row, CPU)", release());
  m.def("prefill_causal_attention", &prefill_causal_attention,
        "causal prefill attention of one sequence over a paged KV cache (fp32 or int8 cache, CPU; "
        "bf16: bf16 GEMMs)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_len"), py::arg("scale"), py::arg("bf16") = false, release());
  m.def("pack_skinny_weight", &pack_skinny_weight, "pack [N, K] fp32 for skinny_linear", release());
  m.def("skinny_linear", &skinny_linear, "x @ W^T (+ bias) (+ residual) for a few rows (fp32, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n_out"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none(), release());
  m.def("int8_activation_levels", &int8_activation_levels,
        "max |code| of x in the int8-activation kernel, for q4 (True) or int8 weights",
        py::arg("q4_weights"));
  m.def("crc32c", &crc32c, "CRC-32C of a contiguous CPU tensor's bytes", release());
  m.def("gather_kv_blocks", &gather_kv_blocks,
        "copy K/V blocks into a transfer payload; returns its CRC-32C", release());
  m.def("scatter_kv_blocks", &scatter_kv_blocks,
        "copy a transfer payload's K/V blocks into the cache", release());
  m.attr("instruction_set") = simd::kName;  // the flags this build targets (simd.h)
  // module_local: each instruction set's build is its own module with its own DecoderStack
  // type, and pybind11 refuses a C++ type registered globally twice.
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local())
      .def(py::init(&make_stack))
      .def("attention_input", &DecoderStack::attention_input, release())
      .def("attention_output_and_mlp", &DecoderStack::attention_output_and_mlp, release())
      .def("decode", &DecoderStack::decode, release());
}

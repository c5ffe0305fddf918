// Python bindings of the CPU extension. Every entry point releases the GIL: the workers' RPC
// threads keep streaming while a step computes.
#include "cpu_kernels.h"

#include <optional>

namespace py = pybind11;

namespace {

using MaybeTensor = std::optional<at::Tensor>;

StackLinear make_linear(const at::Tensor& weight, const MaybeTensor& bias, const MaybeTensor& packed) {
  return StackLinear{weight, bias.value_or(at::Tensor()), packed.value_or(at::Tensor())};
}

// One layer from Python: (input_norm, post_norm, qkv_w, qkv_bias, qkv_packed, o_w, o_packed,
// gate_up_w, gate_up_packed, down_w, down_packed); absent bias / packed weights are None.
using LayerTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, MaybeTensor, MaybeTensor,
                              at::Tensor, MaybeTensor, at::Tensor, MaybeTensor, at::Tensor, MaybeTensor>;

std::unique_ptr<DecoderStack> make_stack(const std::vector<LayerTuple>& layers, int64_t num_heads,
                                         int64_t num_kv_heads, int64_t head_dim, double eps,
                                         int64_t min_packed_rows) {
  std::vector<StackLayer> out;
  for (const auto& t : layers) {
    out.push_back(StackLayer{std::get<0>(t), std::get<1>(t),
                             make_linear(std::get<2>(t), std::get<3>(t), std::get<4>(t)),
                             make_linear(std::get<5>(t), std::nullopt, std::get<6>(t)),
                             make_linear(std::get<7>(t), std::nullopt, std::get<8>(t)),
                             make_linear(std::get<9>(t), std::nullopt, std::get<10>(t))});
  }
  return std::make_unique<DecoderStack>(std::move(out), num_heads, num_kv_heads, head_dim, eps,
                                        min_packed_rows);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (fp32, CPU)", release());
  m.def("prefill_causal_attention", &prefill_causal_attention,
        "causal prefill attention of one sequence over a paged KV cache (fp32, CPU)", release());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init(&make_stack))
      .def("attention_input", &DecoderStack::attention_input, release())
      .def("attention_output_and_mlp", &DecoderStack::attention_output_and_mlp, release())
      .def("decode", &DecoderStack::decode, release());
}

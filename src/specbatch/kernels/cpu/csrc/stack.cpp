#include "stack.h"

#include <optional>
#include <stdexcept>

#include "attention.h"
#include "mlp_block.h"
#include "paged_write.h"

namespace specbatch {

int layer_inputs(bool bias) { return kLayerWeights + 1 + (bias ? 3 : 0); }

std::vector<mx::array> decoder_stack(const mx::array& h, const std::vector<mx::array>& weights,
                                     const std::vector<float>& eps, const mx::array& positions,
                                     const mx::array& inv_freq, const StackShape& shape,
                                     std::vector<mx::array> pools, const mx::array& write_slots,
                                     const mx::array& read_slots, const std::string& mask_kind,
                                     const mx::array& mask, const std::vector<int>& keep) {
  const int per = layer_inputs(shape.bias);
  const size_t layers = pools.size() / 2;
  if (layers == 0 || pools.size() != 2 * layers || weights.size() != layers * per || eps.size() != 2 * layers)
    throw std::invalid_argument("decoder_stack: per layer two pools, two eps and its weights");
  for (int i : keep)
    if (i < 0 || static_cast<size_t>(i) >= layers) throw std::invalid_argument("decoder_stack: keep names a layer");
  std::vector<bool> wanted(layers, false);
  for (int i : keep) wanted[i] = true;
  std::vector<std::optional<mx::array>> after(layers);  // the kept layers' outputs
  mx::array x = h;
  for (size_t i = 0; i < layers; ++i) {
    const mx::array* w = weights.data() + i * per;
    const int b = shape.bias ? 3 : 0;  // the biases sit after wv
    QkvShape qkv = shape.qkv;
    qkv.eps = eps[2 * i];
    std::vector<mx::array> biases(w + 4, w + 4 + b);
    auto q_k_v = qkv_rope(x, w[1], w[2], w[3], biases, positions, inv_freq, qkv, {w[0]});
    pools[2 * i] = paged_write(pools[2 * i], write_slots, q_k_v[1]);
    pools[2 * i + 1] = paged_write(pools[2 * i + 1], write_slots, q_k_v[2]);
    auto heads = paged_attention(q_k_v[0], pools[2 * i], pools[2 * i + 1], read_slots, shape.attn_scale, mask_kind,
                                 mask, true);  // [B, L, Hq * D]
    x = mlp_block(x, heads, w[4 + b], eps[2 * i + 1], w[5 + b], w[6 + b], w[7 + b], w[8 + b]);
    if (wanted[i]) after[i] = x;
  }
  std::vector<mx::array> out{x};
  for (int i : keep) out.push_back(*after[i]);
  out.insert(out.end(), pools.begin(), pools.end());
  return out;
}

}  // namespace specbatch

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arena.h"
#include "attention.h"
#include "gemv.h"
#include "linear.h"
#include "mlp_block.h"
#include "mtp_step.h"
#include "mlx/version.h"
#include "noise.h"
#include "probe.h"
#include "sample.h"
#include "spread.h"
#include "norm.h"
#include "paged_write.h"
#include "pool.h"
#include "projections.h"
#include "reserve.h"
#include "blocks.h"
#include "rope.h"
#include "stack.h"
#include "swiglu.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {
// What Python holds of a stack's checked constants (an opaque handle).
struct StackWeightsHandle {
  std::shared_ptr<const specbatch::StackWeights> held;
};
}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "specbatch's CPU kernels as MLX primitives";
  m.def("small_linear", &specbatch::small_linear, nb::arg("x"), nb::arg("w"),
        "y = x @ w.T (x float32, w float32 or float16; CPU): weights read once for up to 32 rows, blocked beyond; a row's bits never depend on the others");
  m.def("attention", &specbatch::attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask_kind"), nb::arg("mask"), nb::arg("merge_heads") = false, nb::arg("length") = 0,
        "softmax(q k^T * scale) v over a strided KV; mask_kind '', 'causal' or 'array' (bool mask); "
        "length > 0: the first `length` keys only (a cache buffer read in place)");
  m.def("paged_attention", &specbatch::paged_attention, nb::arg("q"), nb::arg("k_pool"), nb::arg("v_pool"),
        nb::arg("slots"), nb::arg("scale"), nb::arg("mask_kind"), nb::arg("mask"), nb::arg("merge_heads") = false,
        "attention over pools [Hkv, P, D] read through slots [B, T] (a paged cache, no gather)");
  m.def("paged_write", &specbatch::paged_write, nb::arg("pool"), nb::arg("slots"), nb::arg("rows"),
        nb::arg("blocked") = false,
        "the pool [H, P, D] with rows [B, H, N, D] stored at slots [B * N], in place where donated (blocked: a "
        "key pool, each 16-slot block [D][16])");
  m.def("pool_reserve", &specbatch::pool_reserve, nb::arg("pool"), nb::arg("axis"), nb::arg("slots"), nb::arg("keep"),
        "the pool with `slots` along its slot axis `axis`: each outer index's first `keep` slots copied, the rest "
        "zero pages resident only once written");
  m.def("paged_write_copies", &specbatch::paged_write_copies, "paged writes so far that copied their pool");
  m.def("add_rms_norm", &specbatch::add_rms_norm, nb::arg("x"), nb::arg("r"), nb::arg("w"), nb::arg("eps"),
        "(x + r, rms_norm(x + r, w, eps)) in one op: a residual add and the norm after it");
  m.def("rms_norm", &specbatch::rms_norm, nb::arg("x"), nb::arg("w"), nb::arg("eps"),
        "x * rsqrt(mean(x^2) + eps) * w per row (float32, CPU), one op");
  m.def("rope", &specbatch::rope, nb::arg("x"), nb::arg("positions"), nb::arg("inv_freq"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("scale"), nb::arg("inverse") = false,
        "rotary embedding of x [B, H, L, D] at positions [1], [B] (offsets) or [B, L], one op");
  m.def("qkv_rope", [](const mx::array& x, const mx::array& wq, const mx::array& wk, const mx::array& wv,
                       const std::vector<mx::array>& biases, const mx::array& positions, const mx::array& inv_freq,
                       int heads, int kv_heads, int dims, bool traditional, float scale,
                       const std::vector<mx::array>& norms, float eps) {
          return specbatch::qkv_rope(x, wq, wk, wv, biases, positions, inv_freq,
                                     specbatch::QkvShape{heads, kv_heads, dims, traditional, scale, eps}, norms);
        }, nb::arg("x"), nb::arg("wq"), nb::arg("wk"), nb::arg("wv"), nb::arg("biases"), nb::arg("positions"),
        nb::arg("inv_freq"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("scale"), nb::arg("norms") = std::vector<mx::array>{}, nb::arg("eps") = 0.0f,
        "a layer's q, k (roped) and v in the head layout, one op for up to 32 rows (norms: the input RMSNorm first)");
  nb::class_<StackWeightsHandle>(m, "StackWeights",
                                 "a decoder stack's weights and eps, checked and evaluated once (stack_weights)");
  m.def("stack_weights", [](const std::vector<mx::array>& weights, const std::vector<float>& eps, int heads,
                            int kv_heads, int dims, bool traditional, float rope_scale, float attn_scale, bool bias) {
          const specbatch::StackShape shape{{heads, kv_heads, dims, traditional, rope_scale}, attn_scale, bias};
          return StackWeightsHandle{specbatch::stack_weights(weights, eps, shape)};
        }, nb::arg("weights"), nb::arg("eps"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("rope_scale"), nb::arg("attn_scale"), nb::arg("bias"),
        "a decoder stack's constants for decoder_stack: each layer's arrays (norm_in, wq, wk, wv, [bq, bk, bv], "
        "norm_post, wg, wu, wd, wo) and its two norms' eps, checked once");
  m.def("decoder_stack", [](const mx::array& h, const StackWeightsHandle& w, const mx::array& positions,
                            const mx::array& inv_freq, const std::vector<mx::array>& buffers,
                            const std::optional<mx::array>& write_slots, const std::optional<mx::array>& read_slots,
                            int start, const std::string& mask_kind, const mx::array& mask,
                            const std::vector<int>& keep) {
          return specbatch::decoder_stack(h, w.held, positions, inv_freq,
                                          specbatch::StackKV{buffers, write_slots, read_slots, start}, mask_kind,
                                          mask, keep);
        }, nb::arg("h"), nb::arg("weights"), nb::arg("positions"), nb::arg("inv_freq"), nb::arg("buffers"),
        nb::arg("write_slots").none(), nb::arg("read_slots").none(), nb::arg("start"), nb::arg("mask_kind"),
        nb::arg("mask"), nb::arg("keep"),
        "a decoder stack's decode or verify forward as one op, over a paged cache (buffers: pools, with slots) or "
        "dense KVCache buffers (from column `start`): [the last layer's output, the kept layers', the written "
        "buffers]");
  m.def("mtp_step", [](const mx::array& h, const mx::array& emb, const mx::array& positions, const mx::array& inv_freq,
                       const mx::array& ctx_k, const mx::array& ctx_v, int length,
                       const std::optional<mx::array>& ctx_mask, const std::vector<mx::array>& own_k,
                       const std::vector<mx::array>& own_v, const std::vector<mx::array>& weights, int heads,
                       int kv_heads, int dims, bool traditional, float rope_scale, float attn_scale,
                       const std::vector<float>& eps, const std::optional<mx::array>& ctx_slots) {
          if (eps.size() != 5) throw std::invalid_argument("mtp_step: eps of enorm, hnorm, input, post and final norms");
          const specbatch::MtpShape shape{{heads, kv_heads, dims, traditional, rope_scale, eps[2]}, attn_scale,
                                          eps[0], eps[1], eps[3], eps[4]};
          return specbatch::mtp_step(h, emb, positions, inv_freq, ctx_k, ctx_v, length, ctx_mask, ctx_slots, own_k,
                                     own_v, weights, shape);
        }, nb::arg("h"), nb::arg("emb"), nb::arg("positions"), nb::arg("inv_freq"), nb::arg("ctx_k"),
        nb::arg("ctx_v"), nb::arg("length"), nb::arg("ctx_mask").none(), nb::arg("own_k"), nb::arg("own_v"),
        nb::arg("weights"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("rope_scale"), nb::arg("attn_scale"), nb::arg("eps"), nb::arg("ctx_slots") = nb::none(),
        "the MTP head's draft step as one op over the target's last-layer KV read in place (dense "
        "[B or 1, Hkv, C, D], or a paged layer's pools [Hkv, P, D] through ctx_slots [B or 1, length]): "
        "[hidden [B, K], k, v [B, Hkv, 1, D]]");
  m.def("gate_up", &specbatch::gate_up, nb::arg("x"), nb::arg("wg"), nb::arg("wu"),
        "x @ wg.T and x @ wu.T in one op for up to 32 rows");
  m.def("mlp_block", &specbatch::mlp_block, nb::arg("x"), nb::arg("r"), nb::arg("norm"), nb::arg("eps"),
        nb::arg("wg"), nb::arg("wu"), nb::arg("wd"), nb::arg("wo") = nb::none(),
        "h + down(swiglu(gate(n), up(n))) for h = x + r (r @ wo.T with wo), n = rms_norm(h): a block's second "
        "half, one op");
  m.def("swiglu", &specbatch::swiglu, nb::arg("gate"), nb::arg("up"),
        "silu(gate) * up (float32, CPU), one op with a vectorised exp");
  m.def("gumbel", &specbatch::gumbel, nb::arg("seeds"), nb::arg("positions"), nb::arg("vocab"),
        "Gumbel noise [B, N, vocab] keyed by (seed, position, token), one op");
  m.def("spread", &specbatch::spread, nb::arg("values"), nb::arg("ids"), nb::arg("vocab"),
        "out[b, ids[j]] = values[b, j], -inf elsewhere (float32 [B, n], int32 [n] -> [B, vocab]; CPU)");
  m.def("sample_tokens", &specbatch::sample_tokens, nb::arg("logits"), nb::arg("temperatures"), nb::arg("seeds"),
        nb::arg("positions"),
        "tokens [B, N]: argmax of logits / max(T, 1e-6) + the keyed Gumbel noise (T = 0: of the logits), one op");
  m.def("isa", [] { return specbatch::isa_name(specbatch::detect_isa()); });
  m.def("pool_cap", &specbatch::Pool::cap, nb::arg("threads"),
        "split the kernels evaluated from now on over at most `threads` threads (0: all)");
  m.def("blocks_register", &specbatch::blocks_register, nb::arg("weight"), nb::arg("q"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("bits"),
        "read a matrix's affine 4- or 8-bit blocks for every row count, where they rebuild its values "
        "bit for bit (q * scale + bias in float32); the bytes a decode row then reads, 0 where refused");
  m.def("blocks_register_rows", &specbatch::blocks_register_rows, nb::arg("rows"), nb::arg("weight"), nb::arg("ids"),
        "read `rows` (= weight[ids]) as those rows of `weight`'s registered blocks; the bytes a decode row then "
        "reads, 0 where refused");
  m.def("blocks_forget", &specbatch::blocks_forget, nb::arg("weight"), "forget the blocks registered for `weight`");
  m.def("blocks_clear", &specbatch::blocks_clear, "forget every registered block set");
  m.def("blocks_pages", [] {
        const auto use = specbatch::arena_use();
        nb::dict d;
        d["bytes"] = use.bytes, d["huge_bytes"] = use.huge_bytes, d["advised"] = specbatch::arena_huge_pages();
        return d;
      },
        "the blocks' records: bytes held, bytes the kernel backs with huge pages now, whether they were asked for");
  m.def("blocks_count", &specbatch::blocks_count, "how many matrices read their blocks");
  m.def("fma_peak_gflops", &specbatch::fma_peak_gflops, nb::arg("iters") = 20000000,
        "float32 GFLOPS of independent FMA chains on every pool thread at once (the compute roofline)");
  m.def("read_bandwidth_gbs", &specbatch::read_bandwidth_gbs, nb::arg("bytes") = 256L << 20, nb::arg("repeats") = 5,
        nb::arg("small_pages") = false,
        "GB/s every pool thread reaches at once streaming its slice of a `bytes` buffer (the read roofline), on "
        "the blocks' pages or on 4 KB ones");
  m.def("half_weights", &specbatch::half_weights_supported,
        "whether the linears take float16 weights (widened exactly as they stream)");
  m.def("threads", [] { return specbatch::pool().size(); });
  m.def("pool_pin", [](bool on) { specbatch::pool().pin(on); }, nb::arg("on"),
        "pin each kernel thread to a core of its own (True, the default) or leave placement to the OS");
  m.def("pool_pinned", [] { return specbatch::pool().pinned(); });
  m.def("pool_spin", &specbatch::Pool::spin, nb::arg("us"),
        "how long an idle kernel worker spins before it sleeps, in microseconds (default 2,000); returns the\n"
        "setting it replaced");
  // the MLX this was compiled against; the loader refuses to run beside another one
  m.attr("built_for_mlx") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) +
                            "." + std::to_string(MLX_VERSION_PATCH);
  m.attr("max_rows") = specbatch::kMaxRows;
}

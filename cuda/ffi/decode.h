// Decoding XLA FFI buffers and attributes into the one AttentionParams the
// kernels read. Shared by the CPU and CUDA handlers, so both check the same
// things: dtypes, the layout attributes, and that every view stays inside its
// buffer (a layout bug in Python becomes an error, never an out-of-bounds read).
//
// Attributes (all int64 unless said), decoded together into LayoutAttrs:
//   instance_sizes : [D]            sizes of the instance axes, D <= kMaxInstanceDims
//   strides        : [kSlots*(D+2)] per slot: D instance strides, row stride, col stride
//   dims           : [4]            T, S, H (q, k), Hv (v, o)
//   scale          : float32 (unused with kScaleOperand: the scale operand holds it)
//   window_left, window_right       kUnbounded (-1) or >= 0
//   diagonal_offset                 added to the window's diagonal (params.h)
//   flags                           bits of jaxflash::Flags
//   keep_threshold                  dropout: keep iff 16 hash bits < it, in [1, 2^16]
//   keep_scale                      float32, dropout: 1 / (1 - rate)
//   softcap                         float32, the logit soft-cap, 0 for none
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "cuda/params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

namespace ffi = xla::ffi;

// Slot order of the "strides" attribute; jaxflash/contract.py lists the same (SLOTS).
enum Slot : int {
  kQ, kK, kV, kBias, kMask, kQLens, kKvLens, kO, kLse, kDo, kDelta, kDq, kDk, kDv, kDbias, kSeed,
  kQSegmentIds, kKvSegmentIds, kAlibiSlopes, kDalibi, kScale, kDscale, kDscaleCentre, kDalibiCentre, kSlots
};

inline const char* slot_name(int slot) {
  static const char* names[kSlots] = {"q",    "k",     "v",    "bias", "mask",          "q_lens",
                                      "kv_lens", "o",   "lse",  "d_o",  "delta",         "dq",
                                      "dk",   "dv",    "dbias", "seed", "q_segment_ids", "kv_segment_ids",
                                      "alibi_slopes", "dalibi", "scale", "dscale", "dscale_centre",
                                      "dalibi_centre"};
  return names[slot];
}

// Every attribute of a call (the header lists them), as the FFI decodes its
// attribute dictionary (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING below).
struct LayoutAttrs {
  ffi::Span<const int64_t> instance_sizes, strides, dims;
  float scale;
  int64_t window_left, window_right, diagonal_offset, flags, keep_threshold;
  float keep_scale, softcap;
};

inline ffi::Error decode_layout(const LayoutAttrs& a, AttentionParams& p) {
  const ffi::Span<const int64_t> instance_sizes = a.instance_sizes, strides = a.strides, dims = a.dims;
  const int64_t D = static_cast<int64_t>(instance_sizes.size());
  if (D > kMaxInstanceDims)
    return ffi::Error::InvalidArgument("jaxflash: too many instance dimensions: " + std::to_string(D));
  if (static_cast<int64_t>(strides.size()) != kSlots * (D + 2))
    return ffi::Error::InvalidArgument("jaxflash: strides attribute has the wrong length");
  if (dims.size() != 4) return ffi::Error::InvalidArgument("jaxflash: dims attribute must be [T, S, H, Hv]");
  if (a.window_left < kUnbounded || a.window_right < kUnbounded)
    return ffi::Error::InvalidArgument("jaxflash: window sizes must be -1 (unbounded) or >= 0");
  p.num_inst_dims = static_cast<int>(D);
  for (int64_t d = 0; d < D; ++d) {
    if (instance_sizes[d] < 1) return ffi::Error::InvalidArgument("jaxflash: instance sizes must be >= 1");
    p.inst_size[d] = instance_sizes[d];
  }
  p.seqlen_q = dims[0];
  p.seqlen_k = dims[1];
  p.head_dim = dims[2];
  p.value_head_dim = dims[3];
  if (p.seqlen_q < 1 || p.seqlen_k < 1 || p.head_dim < 1 || p.value_head_dim < 1)
    return ffi::Error::InvalidArgument("jaxflash: T, S, H and Hv must be >= 1");
  p.scale = a.scale;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.diagonal_offset = a.diagonal_offset;
  p.flags = a.flags;
  if (p.has(kDropout)) {
    if (a.keep_threshold < 1 || a.keep_threshold > kDropoutResolution || !(a.keep_scale >= 1.f))
      return ffi::Error::InvalidArgument("jaxflash: dropout needs 1 <= keep_threshold <= 2^16 and keep_scale >= 1");
    p.keep_threshold = static_cast<uint32_t>(a.keep_threshold);
    p.keep_scale = a.keep_scale;
  }
  if (!(a.softcap >= 0.f) || a.softcap == std::numeric_limits<float>::infinity())
    return ffi::Error::InvalidArgument("jaxflash: softcap must be 0 (none) or a finite float > 0");
  p.softcap = a.softcap;

  ArrayView* views[kSlots] = {&p.q,    &p.k,     &p.v,    &p.bias, &p.mask,          &p.q_lens,
                              &p.kv_lens, &p.o,   &p.lse,  &p.d_o,  &p.delta,         &p.dq,
                              &p.dk,   &p.dv,    &p.dbias, &p.seed, &p.q_segment_ids, &p.kv_segment_ids,
                              &p.alibi_slopes, &p.dalibi, &p.scale_operand, &p.dscale, &p.dscale_centre,
                              &p.dalibi_centre};
  for (int s = 0; s < kSlots; ++s) {
    const int64_t* st = strides.begin() + s * (D + 2);
    for (int64_t d = 0; d < D; ++d) views[s]->inst_stride[d] = st[d];
    views[s]->row_stride = st[D];
    views[s]->col_stride = st[D + 1];
    for (int64_t d = 0; d < D + 2; ++d)
      if (st[d] < 0) return ffi::Error::InvalidArgument(std::string("jaxflash: negative stride for ") + slot_name(s));
  }
  return ffi::Error::Success();
}

// The rows/cols a slot's view spans (lse-like and length views have no cols).
inline void view_extent(const AttentionParams& p, int slot, int64_t& rows, int64_t& cols) {
  switch (slot) {
    case kBias: case kMask: case kDbias: rows = p.seqlen_q; cols = p.seqlen_k; return;
    case kLse: case kDelta: case kDscaleCentre: case kDalibiCentre: rows = p.seqlen_q; cols = 1; return;
    case kQLens: case kKvLens: case kAlibiSlopes: case kScale: rows = 1; cols = 1; return;
    case kSeed: rows = 1; cols = p.has(kDropoutOffsets) ? 4 : 2; return;
    case kQSegmentIds: rows = p.seqlen_q; cols = 1; return;
    case kKvSegmentIds: case kDscale: case kDalibi: rows = p.seqlen_k; cols = 1; return;
    case kK: case kDk: rows = p.seqlen_k; cols = p.head_dim; return;
    case kV: case kDv: rows = p.seqlen_k; cols = p.value_head_dim; return;
    case kO: case kDo: rows = p.seqlen_q; cols = p.value_head_dim; return;
    default: rows = p.seqlen_q; cols = p.head_dim; return;  // q, dq
  }
}

// Points `view` at `buffer` after checking its element type and that the
// furthest element the view can address lies inside the buffer.
template <class Buffer>
ffi::Error attach(const AttentionParams& p, int slot, ArrayView& view, Buffer& buffer,
                  ffi::DataType expected_type) {
  if (buffer.element_type() != expected_type)
    return ffi::Error::InvalidArgument(std::string("jaxflash: unexpected element type for ") + slot_name(slot));
  int64_t rows, cols;
  view_extent(p, slot, rows, cols);
  int64_t last = (rows - 1) * view.row_stride + (cols - 1) * view.col_stride;
  for (int d = 0; d < p.num_inst_dims; ++d) last += (p.inst_size[d] - 1) * view.inst_stride[d];
  if (static_cast<int64_t>(buffer.element_count()) <= last)
    return ffi::Error::InvalidArgument(std::string("jaxflash: layout of ") + slot_name(slot) +
                                       " reaches past its buffer");
  view.data = buffer.untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error decode_dtype(ffi::DataType type, DType& out, const char* what) {
  switch (type) {
    case ffi::DataType::F32: out = DType::kF32; return ffi::Error::Success();
    case ffi::DataType::F16: out = DType::kF16; return ffi::Error::Success();
    case ffi::DataType::BF16: out = DType::kBF16; return ffi::Error::Success();
    default: return ffi::Error::InvalidArgument(std::string("jaxflash: unsupported dtype for ") + what);
  }
}

inline ffi::DataType ffi_type(DType t) {
  switch (t) {
    case DType::kF16: return ffi::DataType::F16;
    case DType::kBF16: return ffi::DataType::BF16;
    default: return ffi::DataType::F32;
  }
}

// Attaches an optional operand when its flag is set; absent operands arrive as
// zero-size buffers and must stay detached.
template <class Buffer>
ffi::Error attach_optional(const AttentionParams& p, int64_t flag, int slot, ArrayView& view,
                           Buffer& buffer, ffi::DataType expected_type) {
  if (!p.has(flag)) {
    if (buffer.element_count() != 0)
      return ffi::Error::InvalidArgument(std::string("jaxflash: ") + slot_name(slot) + " given but not flagged");
    return ffi::Error::Success();
  }
  return attach(p, slot, view, buffer, expected_type);
}

// Decodes the operands every direction shares: q, k, v, bias, mask, lengths, seed, segment ids,
// ALiBi slopes, scale.
inline ffi::Error attach_inputs(AttentionParams& p, ffi::AnyBuffer& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                                ffi::AnyBuffer& bias, ffi::AnyBuffer& mask, ffi::AnyBuffer& q_lens,
                                ffi::AnyBuffer& kv_lens, ffi::AnyBuffer& seed, ffi::AnyBuffer& q_segment_ids,
                                ffi::AnyBuffer& kv_segment_ids, ffi::AnyBuffer& alibi_slopes,
                                ffi::AnyBuffer& scale) {
  if (auto e = decode_dtype(q.element_type(), p.dtype, "q"); e.failure()) return e;
  const ffi::DataType t = ffi_type(p.dtype);
  p.bias_dtype = p.dtype;
  if (p.has(kHasBias)) {
    if (auto e = decode_dtype(bias.element_type(), p.bias_dtype, "bias"); e.failure()) return e;
    if (p.bias_dtype != p.dtype && p.bias_dtype != DType::kF32)
      return ffi::Error::InvalidArgument("jaxflash: bias dtype must be the query dtype or float32");
  }
  if (auto e = attach(p, kQ, p.q, q, t); e.failure()) return e;
  if (auto e = attach(p, kK, p.k, k, t); e.failure()) return e;
  if (auto e = attach(p, kV, p.v, v, t); e.failure()) return e;
  if (auto e = attach_optional(p, kHasBias, kBias, p.bias, bias, ffi_type(p.bias_dtype)); e.failure()) return e;
  if (auto e = attach_optional(p, kHasMask, kMask, p.mask, mask, ffi::DataType::PRED); e.failure()) return e;
  if (auto e = attach_optional(p, kHasQLens, kQLens, p.q_lens, q_lens, ffi::DataType::S32); e.failure()) return e;
  if (auto e = attach_optional(p, kHasKvLens, kKvLens, p.kv_lens, kv_lens, ffi::DataType::S32); e.failure())
    return e;
  if (p.has(kDropoutOffsets) && !p.has(kDropout))
    return ffi::Error::InvalidArgument("jaxflash: dropout offsets given without dropout");
  if (auto e = attach_optional(p, kDropout, kSeed, p.seed, seed, ffi::DataType::U32); e.failure()) return e;
  if (auto e = attach_optional(p, kHasSegmentIds, kQSegmentIds, p.q_segment_ids, q_segment_ids, ffi::DataType::S32);
      e.failure())
    return e;
  if (auto e = attach_optional(p, kHasSegmentIds, kKvSegmentIds, p.kv_segment_ids, kv_segment_ids,
                               ffi::DataType::S32);
      e.failure())
    return e;
  if (auto e = attach_optional(p, kHasAlibi, kAlibiSlopes, p.alibi_slopes, alibi_slopes, ffi::DataType::F32);
      e.failure())
    return e;
  return attach_optional(p, kScaleOperand, kScale, p.scale_operand, scale, ffi::DataType::F32);
}

// The backward's outputs must have one writer per element: dq and dalibi (per query head) may
// not be shared along any instance axis, and dk, dv and dscale must be shared along the same ones
// (the axes the K/V-outer pass reduces over). A scale operand must be shared along the axes
// that dk, dv or dbias sum over: the CUDA backward reads one scale per K/V tile and per dbias
// tile (vmap gives every mapped item its own gradients, so it never sums over a scale's axis).
inline ffi::Error check_gradient_layouts(const AttentionParams& p) {
  for (int d = 0; d < p.num_inst_dims; ++d) {
    if (p.inst_size[d] == 1) continue;
    if (p.has(kScaleOperand) && p.scale_operand.inst_stride[d] != 0 &&
        (p.dk.inst_stride[d] == 0 || (p.has(kHasDbias) && p.dbias.inst_stride[d] == 0)))
      return ffi::Error::InvalidArgument(
          "jaxflash: the scale operand varies along an instance axis that dk, dv or dbias sum over");
    if (p.dq.inst_stride[d] == 0) return ffi::Error::InvalidArgument("jaxflash: dq is broadcast along an instance axis");
    if (p.has(kHasDalibi) && p.dalibi.inst_stride[d] == 0)
      return ffi::Error::InvalidArgument("jaxflash: dalibi is broadcast along an instance axis");
    if ((p.dk.inst_stride[d] == 0) != (p.dv.inst_stride[d] == 0) ||
        (p.has(kHasDscale) && (p.dk.inst_stride[d] == 0) != (p.dscale.inst_stride[d] == 0)))
      return ffi::Error::InvalidArgument("jaxflash: dk, dv and dscale must be broadcast along the same instance axes");
  }
  return ffi::Error::Success();
}

// The whole decode of each direction, shared by the CPU and CUDA handlers.
// The operands every direction takes first (bind_inputs).
struct Inputs {
  ffi::AnyBuffer q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, alibi_slopes, scale;
};

// The layout, then the shared operands.
inline ffi::Error decode_inputs(AttentionParams& p, Inputs& in, const LayoutAttrs& attrs) {
  if (auto e = decode_layout(attrs, p); e.failure()) return e;
  return attach_inputs(p, in.q, in.k, in.v, in.bias, in.mask, in.q_lens, in.kv_lens, in.seed, in.q_segment_ids,
                       in.kv_segment_ids, in.alibi_slopes, in.scale);
}

inline ffi::Error decode_forward(AttentionParams& p, Inputs in, ffi::AnyBuffer& o, ffi::AnyBuffer& lse,
                                 const LayoutAttrs& attrs) {
  if (auto e = decode_inputs(p, in, attrs); e.failure()) return e;
  const ffi::DataType o_type = p.has(kOutputF32) ? ffi::DataType::F32 : ffi_type(p.dtype);
  if (auto e = attach(p, kO, p.o, o, o_type); e.failure()) return e;
  return attach(p, kLse, p.lse, lse, ffi::DataType::F32);
}

inline ffi::Error decode_backward(AttentionParams& p, Inputs in, ffi::AnyBuffer& lse, ffi::AnyBuffer& delta,
                                  ffi::AnyBuffer& d_o, ffi::AnyBuffer& dscale_centre,
                                  ffi::AnyBuffer& dalibi_centre, ffi::AnyBuffer& dq, ffi::AnyBuffer& dk, ffi::AnyBuffer& dv,
                                  ffi::AnyBuffer& dbias, ffi::AnyBuffer& dalibi, ffi::AnyBuffer& dscale,
                                  const LayoutAttrs& attrs) {
  if (auto e = decode_inputs(p, in, attrs); e.failure()) return e;
  const ffi::DataType t = ffi_type(p.dtype);
  if (auto e = attach(p, kLse, p.lse, lse, ffi::DataType::F32); e.failure()) return e;
  if (auto e = attach(p, kDelta, p.delta, delta, ffi::DataType::F32); e.failure()) return e;
  if (auto e = attach(p, kDo, p.d_o, d_o, t); e.failure()) return e;
  // kScaleOperand: dq of the scaled query, in float32 (params.h).
  if (auto e = attach(p, kDq, p.dq, dq, p.has(kScaleOperand) ? ffi::DataType::F32 : t); e.failure()) return e;
  if (auto e = attach(p, kDk, p.dk, dk, t); e.failure()) return e;
  if (auto e = attach(p, kDv, p.dv, dv, t); e.failure()) return e;
  if (auto e = attach_optional(p, kHasDbias, kDbias, p.dbias, dbias, ffi_type(p.bias_dtype)); e.failure())
    return e;
  if (p.has(kHasDalibi) && !p.has(kHasAlibi))
    return ffi::Error::InvalidArgument("jaxflash: dalibi asked for without alibi_slopes");
  if (auto e = attach_optional(p, kHasDalibi, kDalibi, p.dalibi, dalibi, ffi::DataType::F32); e.failure())
    return e;
  if (auto e = attach_optional(p, kHasDalibi, kDalibiCentre, p.dalibi_centre, dalibi_centre, ffi::DataType::F32);
      e.failure())
    return e;
  if (p.has(kHasDscale) && !p.has(kScaleOperand))
    return ffi::Error::InvalidArgument("jaxflash: dscale asked for without a scale operand");
  if (auto e = attach_optional(p, kHasDscale, kDscale, p.dscale, dscale, ffi::DataType::F32); e.failure())
    return e;
  if (auto e = attach_optional(p, kHasDscale, kDscaleCentre, p.dscale_centre, dscale_centre, ffi::DataType::F32);
      e.failure())
    return e;
  return check_gradient_layouts(p);
}

// The FFI signatures, after each platform's context (thread pool or stream).
// Forward: inputs, then results o, lse, workspace. Backward: inputs, lse, delta,
// d_o, dscale_centre, dalibi_centre, then results dq, dk, dv, dbias, dalibi, dscale, workspace. Both end with the layout attributes.
// (Bindings are move-only with a private move constructor: taken by &&.)
template <class Binding>
auto bind_inputs(Binding&& binding) {  // q, k, v, bias, mask, q_lens, kv_lens, seed, segment ids, slopes, scale
  return std::move(binding).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>();
}

template <class Binding>
auto bind_attributes(Binding&& binding) {
  return std::move(binding).template Attrs<LayoutAttrs>();
}

template <class Binding>
auto bind_forward(Binding&& binding) {
  return bind_attributes(bind_inputs(std::move(binding))
                             .template Ret<ffi::AnyBuffer>()    // o
                             .template Ret<ffi::AnyBuffer>()    // lse
                             .template Ret<ffi::AnyBuffer>());  // workspace
}

template <class Binding>
auto bind_backward(Binding&& binding) {
  return bind_attributes(bind_inputs(std::move(binding))
                             .template Arg<ffi::AnyBuffer>()   // lse
                             .template Arg<ffi::AnyBuffer>()   // delta
                             .template Arg<ffi::AnyBuffer>()   // d_o
                             .template Arg<ffi::AnyBuffer>()   // dscale_centre
                             .template Arg<ffi::AnyBuffer>()   // dalibi_centre
                             .template Ret<ffi::AnyBuffer>()   // dq
                             .template Ret<ffi::AnyBuffer>()   // dk
                             .template Ret<ffi::AnyBuffer>()   // dv
                             .template Ret<ffi::AnyBuffer>()   // dbias
                             .template Ret<ffi::AnyBuffer>()   // dalibi
                             .template Ret<ffi::AnyBuffer>()   // dscale
                             .template Ret<ffi::AnyBuffer>());  // workspace
}

}  // namespace jaxflash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxflash::LayoutAttrs,
                                      xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("instance_sizes"),
                                      xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("strides"),
                                      xla::ffi::StructMember<xla::ffi::Span<const int64_t>>("dims"),
                                      xla::ffi::StructMember<float>("scale"),
                                      xla::ffi::StructMember<int64_t>("window_left"),
                                      xla::ffi::StructMember<int64_t>("window_right"),
                                      xla::ffi::StructMember<int64_t>("diagonal_offset"),
                                      xla::ffi::StructMember<int64_t>("flags"),
                                      xla::ffi::StructMember<int64_t>("keep_threshold"),
                                      xla::ffi::StructMember<float>("keep_scale"),
                                      xla::ffi::StructMember<float>("softcap"));

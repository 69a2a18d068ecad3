// The DP-SGD step's kernels: per-example clipping for clipping.py's one pass, and the noise add
// (dp_sgd.py), as TensorFlow CPU ops. Each replaces a chain of small graph ops whose fixed cost
// per op (a few microseconds of TensorFlow's executor) or whose intermediate tensors (a
// convolution's patches) were most of DP-SGD's overhead on small models (docs/measurements.md).
//
// Every op is a function of its inputs alone: no state, no randomness, and no branch on the
// values (a dropped row is zeroed by a bit mask, not skipped), so its running time depends on
// shapes only. float and double (AddNoise: float, as the noise buffer).
//
//   ConvPerExampleGradients  a Conv2D call's per-example kernel and bias gradients and their
//                            squared norms, without forming the patches
//   DenseSquaredNorms        |grad_i W|^2 + |grad_i b|^2 of a Dense call with one position
//   ClippedRows              rows scaled by the clip coefficients, dropped rows exactly zero
//   KeptWeightedSum          sum_i c_i g_i over the kept rows of per-example gradients g
//   AddNoise                 clipped sums plus the next draws of the noise buffer, reshaped
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sage_tfx {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

template <typename T>
using MaskOf = typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type;

// value where mask is all ones, +0.0 where it is zero, through the bits: no branch on the
// mask, and 0 even where value is inf or NaN (a multiply by 0 would give NaN there).
template <typename T>
inline T KeptOrZero(T value, MaskOf<T> mask) {
  MaskOf<T> bits;
  std::memcpy(&bits, &value, sizeof(T));
  bits &= mask;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

// sum of values[i]^2 in double, over eight independent running sums (one per lane): a single
// running sum would wait on each add's latency, the lanes vectorize.
template <typename T>
inline double SumOfSquares(const T* values, int64_t count) {
  double lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    for (int k = 0; k < 8; ++k) lanes[k] += double(values[i + k]) * double(values[i + k]);
  }
  double total = 0;
  for (; i < count; ++i) total += double(values[i]) * double(values[i]);
  for (int k = 0; k < 8; ++k) total += lanes[k];
  return total;
}

template <typename T>
std::vector<MaskOf<T>> RowMasks(const Tensor& kept) {
  auto flags = kept.flat<bool>();
  std::vector<MaskOf<T>> masks(flags.size());
  for (int64_t row = 0; row < flags.size(); ++row) {
    masks[row] = MaskOf<T>(0) - MaskOf<T>(flags(row) ? 1 : 0);
  }
  return masks;
}

// work(begin, end) over [0, units): on the caller's thread when the whole costs less than
// handing shards to the pool does (a few microseconds: most of these ops' calls on a small
// model), else sharded over TensorFlow's intra-op threads. cost_per_unit: about the unit's
// multiply-adds.
void ParallelFor(OpKernelContext* context, int64_t units, int64_t cost_per_unit,
                 const std::function<void(int64_t, int64_t)>& work) {
  constexpr int64_t kInlineCost = 1 << 17;
  if (units * cost_per_unit < kInlineCost) {
    work(0, units);
    return;
  }
  context->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(units, cost_per_unit,
                                                                           work);
}

tensorflow::Status RequireRank(const Tensor& tensor, int rank, const char* name) {
  if (tensor.dims() != rank) {
    return tensorflow::errors::InvalidArgument(name, " must have rank ", rank, ", got shape ",
                                               tensor.shape().DebugString());
  }
  return tensorflow::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// ConvPerExampleGradients
//
// For example i, kernel offset (u, v), input channel c and output channel o:
//   grad_i W[u, v, c, o] = sum over output positions (y, x) of
//                          X_i[y s_h + u d_h - p_h, x s_w + v d_w - p_w, c] * dZ_i[y, x, o]
// (X zero outside the image: padding), and grad_i b[o] = sum_(y, x) dZ_i[y, x, o]. This is the
// kernel gradient of the example's own convolution (Conv2DBackpropFilter of one example).
// squared_norms[i] = |grad_i W|^2 (+ |grad_i b|^2 with use_bias), summed in double.
// With per_example false, grad_i W is summed into its norm and not kept (kernel_gradients is
// then empty): memory O(B) for a layer whose B kernel copies would be large.
//
// Work per example: positions * kh * kw * C * O multiply-adds, as the batch's kernel gradient
// does per example; the clipped sum is then sum_i c_i grad_i W (KeptWeightedSum), B kh kw C O
// more, so the private step does no second kernel gradient. Each kernel row (u, v, c) is
// accumulated over the positions in registers (vector lanes over o), four rows at a time, so
// each output gradient row is loaded once per four rows.

REGISTER_OP("ConvPerExampleGradients")
    .Input("inputs: T")
    .Input("output_gradients: T")
    .Output("squared_norms: T")
    .Output("kernel_gradients: T")
    .Output("bias_gradients: T")
    .Attr("T: {float, double}")
    .Attr("kernel_size: list(int) >= 2")
    .Attr("strides: list(int) >= 2")
    .Attr("dilations: list(int) >= 2")
    .Attr("pad_before: list(int) >= 2")
    .Attr("use_bias: bool")
    .Attr("per_example: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle inputs, grads;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &inputs));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &grads));
      std::vector<int32_t> kernel_size;
      TF_RETURN_IF_ERROR(c->GetAttr("kernel_size", &kernel_size));
      DimensionHandle batch = c->Dim(inputs, 0), channels = c->Dim(inputs, 3),
                      outputs = c->Dim(grads, 3);
      bool per_example;
      TF_RETURN_IF_ERROR(c->GetAttr("per_example", &per_example));
      c->set_output(0, c->Vector(batch));
      c->set_output(1, per_example ? c->MakeShape({batch, c->MakeDim(kernel_size[0]),
                                                   c->MakeDim(kernel_size[1]), channels, outputs})
                                   : c->Vector(0));
      c->set_output(2, c->Matrix(batch, outputs));
      return tensorflow::OkStatus();
    });

template <typename T>
class ConvPerExampleGradientsOp : public OpKernel {
 public:
  // Two vectors of 32 bytes per block of output channels: 16 floats or 8 doubles.
  typedef T Vector __attribute__((vector_size(32)));
  static constexpr int kVectorLanes = 32 / sizeof(T);
  static constexpr int kBlock = 2 * kVectorLanes;

  explicit ConvPerExampleGradientsOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("kernel_size", &kernel_size_));
    OP_REQUIRES_OK(context, context->GetAttr("strides", &strides_));
    OP_REQUIRES_OK(context, context->GetAttr("dilations", &dilations_));
    OP_REQUIRES_OK(context, context->GetAttr("pad_before", &pad_before_));
    OP_REQUIRES_OK(context, context->GetAttr("use_bias", &use_bias_));
    OP_REQUIRES_OK(context, context->GetAttr("per_example", &per_example_));
    for (const auto* list : {&kernel_size_, &strides_, &dilations_}) {
      OP_REQUIRES(context, list->size() == 2 && (*list)[0] >= 1 && (*list)[1] >= 1,
                  tensorflow::errors::InvalidArgument(
                      "kernel_size, strides and dilations must be two positive integers"));
    }
    OP_REQUIRES(context, pad_before_.size() == 2 && pad_before_[0] >= 0 && pad_before_[1] >= 0,
                tensorflow::errors::InvalidArgument("pad_before must be two integers >= 0"));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& inputs = context->input(0);
    const Tensor& grads = context->input(1);
    OP_REQUIRES_OK(context, RequireRank(inputs, 4, "inputs"));
    OP_REQUIRES_OK(context, RequireRank(grads, 4, "output_gradients"));
    const int64_t batch = inputs.dim_size(0), height = inputs.dim_size(1),
                  width = inputs.dim_size(2), channels = inputs.dim_size(3);
    const int64_t out_height = grads.dim_size(1), out_width = grads.dim_size(2),
                  outputs = grads.dim_size(3);
    OP_REQUIRES(context, grads.dim_size(0) == batch,
                tensorflow::errors::InvalidArgument("inputs and output_gradients differ in "
                                                    "batch size"));
    const int64_t kh = kernel_size_[0], kw = kernel_size_[1];
    const int64_t positions = out_height * out_width, rows = kh * kw * channels;
    const int64_t padded_outputs = (outputs + kBlock - 1) / kBlock * kBlock;
    // The zero-padded image spans every pixel an offset reads, whatever the attributes say.
    const int64_t padded_height = std::max(
        height + pad_before_[0], (out_height - 1) * strides_[0] + (kh - 1) * dilations_[0] + 1);
    const int64_t padded_width = std::max(
        width + pad_before_[1], (out_width - 1) * strides_[1] + (kw - 1) * dilations_[1] + 1);

    Tensor *norms, *kernel_grads, *bias_grads;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({batch}), &norms));
    OP_REQUIRES_OK(context, context->allocate_output(
                                1, per_example_ ? TensorShape({batch, kh, kw, channels, outputs})
                                                : TensorShape({0}),
                                &kernel_grads));
    OP_REQUIRES_OK(context,
                   context->allocate_output(2, TensorShape({batch, outputs}), &bias_grads));
    const T* image_data = inputs.flat<T>().data();
    const T* grad_data = grads.flat<T>().data();
    T* norm_data = norms->flat<T>().data();
    T* kernel_data = kernel_grads->flat<T>().data();
    T* bias_data = bias_grads->flat<T>().data();

    std::vector<int64_t> pixel(positions);  // each position's top-left pixel, times channels
    for (int64_t y = 0; y < out_height; ++y) {
      for (int64_t x = 0; x < out_width; ++x) {
        pixel[y * out_width + x] =
            (y * strides_[0] * padded_width + x * strides_[1]) * channels;
      }
    }
    auto examples = [&](int64_t begin, int64_t end) {
      std::vector<T> padded(padded_height * padded_width * channels, T(0));
      std::vector<T> dz(positions * padded_outputs, T(0));
      std::vector<const T*> row_sources(rows);
      for (int64_t i = begin; i < end; ++i) {
        const T* image = image_data + i * height * width * channels;
        const T* grad = grad_data + i * positions * outputs;
        for (int64_t y = 0; y < height; ++y) {
          std::copy(image + y * width * channels, image + (y + 1) * width * channels,
                    padded.data() + ((y + pad_before_[0]) * padded_width + pad_before_[1]) *
                                        channels);
        }
        for (int64_t t = 0; t < positions; ++t) {
          std::copy(grad + t * outputs, grad + (t + 1) * outputs, dz.data() + t * padded_outputs);
        }
        for (int64_t u = 0, row = 0; u < kh; ++u) {
          for (int64_t v = 0; v < kw; ++v) {
            for (int64_t c = 0; c < channels; ++c, ++row) {
              row_sources[row] =
                  padded.data() + (u * dilations_[0] * padded_width + v * dilations_[1]) *
                                      channels + c;
            }
          }
        }
        double total = 0;
        T* kernel = per_example_ ? kernel_data + i * rows * outputs : nullptr;
        auto rows_out = [&](int64_t row) { return kernel ? kernel + row * outputs : nullptr; };
        int64_t row = 0;
        for (; row + 4 <= rows; row += 4) {
          total += KernelRows<4>(row_sources.data() + row, pixel.data(), dz.data(), positions,
                                 padded_outputs, outputs, rows_out(row));
        }
        for (; row < rows; ++row) {
          total += KernelRows<1>(row_sources.data() + row, pixel.data(), dz.data(), positions,
                                 padded_outputs, outputs, rows_out(row));
        }
        for (int64_t o = 0; o < outputs; ++o) {
          T sum = 0;
          for (int64_t t = 0; t < positions; ++t) sum += grad[t * outputs + o];
          bias_data[i * outputs + o] = sum;
          if (use_bias_) total += double(sum) * double(sum);
        }
        norm_data[i] = T(total);
      }
    };
    ParallelFor(context, batch, positions * rows * padded_outputs * 2, examples);
  }

 private:
  // `count` kernel rows of one example: out[r, o] = sum_t sources[r][pixel[t]] dz[t, o] (not
  // written where out is null); returns the sum of their squares.
  template <int count>
  static double KernelRows(const T* const* sources, const int64_t* pixel, const T* dz,
                           int64_t positions, int64_t padded_outputs, int64_t outputs, T* out) {
    double total = 0;
    for (int64_t first = 0; first < padded_outputs; first += kBlock) {
      Vector sums[count][2] = {};
      for (int64_t t = 0; t < positions; ++t) {
        Vector low, high;
        std::memcpy(&low, dz + t * padded_outputs + first, sizeof(Vector));
        std::memcpy(&high, dz + t * padded_outputs + first + kVectorLanes, sizeof(Vector));
        for (int r = 0; r < count; ++r) {
          const T input = sources[r][pixel[t]];
          sums[r][0] += input * low;
          sums[r][1] += input * high;
        }
      }
      T block[count][kBlock];  // lanes past `outputs` hold 0 (dz is zero-padded there)
      std::memcpy(block, sums, sizeof(block));
      total += SumOfSquares(&block[0][0], count * kBlock);
      if (out != nullptr) {
        const int64_t lanes = std::min<int64_t>(kBlock, outputs - first);
        for (int r = 0; r < count; ++r) {
          std::copy(block[r], block[r] + lanes, out + r * outputs + first);
        }
      }
    }
    return total;
  }

  std::vector<int32_t> kernel_size_, strides_, dilations_, pad_before_;
  bool use_bias_, per_example_;
};

// ---------------------------------------------------------------------------------------------
// DenseSquaredNorms: for a Dense call with one position per example (inputs [B, P], output
// gradients [B, O]), grad_i W = a_i dz_i^T and grad_i b = dz_i, so
//   |grad_i W|^2 + |grad_i b|^2 = (|a_i|^2 + 1) |dz_i|^2
// (without the 1 for a layer without bias), in double.

REGISTER_OP("DenseSquaredNorms")
    .Input("inputs: T")
    .Input("output_gradients: T")
    .Output("squared_norms: T")
    .Attr("T: {float, double}")
    .Attr("use_bias: bool")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle inputs, grads;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &inputs));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &grads));
      c->set_output(0, c->Vector(c->Dim(inputs, 0)));
      return tensorflow::OkStatus();
    });

template <typename T>
class DenseSquaredNormsOp : public OpKernel {
 public:
  explicit DenseSquaredNormsOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("use_bias", &use_bias_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& inputs = context->input(0);
    const Tensor& grads = context->input(1);
    OP_REQUIRES_OK(context, RequireRank(inputs, 2, "inputs"));
    OP_REQUIRES_OK(context, RequireRank(grads, 2, "output_gradients"));
    const int64_t batch = inputs.dim_size(0), width = inputs.dim_size(1),
                  outputs = grads.dim_size(1);
    OP_REQUIRES(context, grads.dim_size(0) == batch,
                tensorflow::errors::InvalidArgument("inputs and output_gradients differ in "
                                                    "batch size"));
    Tensor* norms;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({batch}), &norms));
    const T* input_data = inputs.flat<T>().data();
    const T* grad_data = grads.flat<T>().data();
    T* norm_data = norms->flat<T>().data();
    const double bias = use_bias_ ? 1.0 : 0.0;
    ParallelFor(context, batch, (width + outputs) * 2, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        norm_data[i] = T((SumOfSquares(input_data + i * width, width) + bias) *
                         SumOfSquares(grad_data + i * outputs, outputs));
      }
    });
  }

 private:
  bool use_bias_;
};

// ---------------------------------------------------------------------------------------------
// ClippedRows: for each tensor [B, ...], row i times coefficients[i] (where its scale flag is
// set) or unchanged (where not), where kept[i]; exactly +0 where not, even where the row holds inf or NaN. A kept
// row keeps IEEE products (inf * 0 is NaN: an overflow stays visible to the guard that drops
// rows).

REGISTER_OP("ClippedRows")
    .Input("values: N * T")
    .Input("coefficients: T")
    .Input("kept: bool")
    .Output("rows: N * T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("scale: list(bool)")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return tensorflow::OkStatus();
    });

template <typename T>
class ClippedRowsOp : public OpKernel {
 public:
  explicit ClippedRowsOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* context) override {
    tensorflow::OpInputList values;
    OP_REQUIRES_OK(context, context->input_list("values", &values));
    OP_REQUIRES(context, static_cast<int>(scale_.size()) == values.size(),
                tensorflow::errors::InvalidArgument("scale needs one flag per tensor"));
    const Tensor& coefficients = context->input(values.size());
    const Tensor& kept = context->input(values.size() + 1);
    const int64_t batch = kept.NumElements();
    OP_REQUIRES(context, coefficients.NumElements() == batch,
                tensorflow::errors::InvalidArgument("coefficients and kept differ in size"));
    const std::vector<MaskOf<T>> masks = RowMasks<T>(kept);
    const T* coefficient = coefficients.flat<T>().data();
    tensorflow::OpOutputList rows;
    OP_REQUIRES_OK(context, context->output_list("rows", &rows));
    for (int n = 0; n < values.size(); ++n) {
      const Tensor& tensor = values[n];
      OP_REQUIRES(context, tensor.dims() >= 1 && tensor.dim_size(0) == batch,
                  tensorflow::errors::InvalidArgument("values must have ", batch, " rows, got ",
                                                      tensor.shape().DebugString()));
      Tensor* out;
      OP_REQUIRES_OK(context, rows.allocate(n, tensor.shape(), &out));
      const int64_t width = batch ? tensor.NumElements() / batch : 0;
      const T* in_data = tensor.flat<T>().data();
      T* out_data = out->flat<T>().data();
      const bool scale = scale_[n];
      ParallelFor(context, batch, width * 2, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const T factor = scale ? coefficient[i] : T(1);
          for (int64_t k = 0; k < width; ++k) {
            const T value = scale ? in_data[i * width + k] * factor : in_data[i * width + k];
            out_data[i * width + k] = KeptOrZero<T>(value, masks[i]);
          }
        }
      });
    }
  }

 private:
  std::vector<bool> scale_;
};

// ---------------------------------------------------------------------------------------------
// KeptWeightedSum: sum over the rows i where kept[i] of coefficients[i] * values[i], for
// per-example gradients values [B, ...]; a dropped row adds exactly +0 (as ClippedRows), with
// no branch on kept. Summed in the rows' order, per entry.

REGISTER_OP("KeptWeightedSum")
    .Input("values: T")
    .Input("coefficients: T")
    .Input("kept: bool")
    .Output("sum: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle rest;
      TF_RETURN_IF_ERROR(c->Subshape(c->input(0), 1, &rest));
      c->set_output(0, rest);
      return tensorflow::OkStatus();
    });

template <typename T>
class KeptWeightedSumOp : public OpKernel {
 public:
  explicit KeptWeightedSumOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& values = context->input(0);
    const Tensor& coefficients = context->input(1);
    const Tensor& kept = context->input(2);
    OP_REQUIRES(context, values.dims() >= 1,
                tensorflow::errors::InvalidArgument("values must have a batch dimension"));
    const int64_t batch = values.dim_size(0);
    OP_REQUIRES(context, coefficients.NumElements() == batch && kept.NumElements() == batch,
                tensorflow::errors::InvalidArgument("coefficients and kept need ", batch,
                                                    " entries"));
    TensorShape shape = values.shape();
    shape.RemoveDim(0);
    Tensor* sum;
    OP_REQUIRES_OK(context, context->allocate_output(0, shape, &sum));
    const int64_t width = shape.num_elements();
    const std::vector<MaskOf<T>> masks = RowMasks<T>(kept);
    const T* coefficient = coefficients.flat<T>().data();
    const T* value_data = values.flat<T>().data();
    T* sum_data = sum->flat<T>().data();
    ParallelFor(context, width, batch * 2, [&](int64_t begin, int64_t end) {
      std::fill(sum_data + begin, sum_data + end, T(0));
      for (int64_t i = 0; i < batch; ++i) {
        const T* row = value_data + i * width;
        for (int64_t k = begin; k < end; ++k) {
          sum_data[k] += KeptOrZero<T>(coefficient[i] * row[k], masks[i]);
        }
      }
    });
  }
};

// ---------------------------------------------------------------------------------------------
// AddNoise: gradients[n] + the next draws of the step's noise buffer, reshaped: tensor n reads
// draws[start + o_n, start + o_n + size_n), o_n the sizes of the tensors before it. The draws
// are independent N(0, s^2) (dp_sgd.NoiseBuffer); a step that asks for more than the buffer
// holds from `start` is an error, so a draw is never served twice or short. next: the first
// position the step left unread.

REGISTER_OP("AddNoise")
    .Input("gradients: N * float")
    .Input("draws: float")
    .Input("start: int64")
    .Output("noisy: N * float")
    .Output("next: int64")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i + 1 < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      c->set_output(c->num_outputs() - 1, c->Scalar());
      return tensorflow::OkStatus();
    });

class AddNoiseOp : public OpKernel {
 public:
  explicit AddNoiseOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    tensorflow::OpInputList gradients;
    OP_REQUIRES_OK(context, context->input_list("gradients", &gradients));
    const Tensor& draws = context->input(gradients.size());
    const Tensor& start_tensor = context->input(gradients.size() + 1);
    OP_REQUIRES(context, tensorflow::TensorShapeUtils::IsScalar(start_tensor.shape()),
                tensorflow::errors::InvalidArgument("start must be a scalar"));
    const int64_t start = start_tensor.scalar<int64_t>()();
    int64_t total = 0;
    for (const Tensor& gradient : gradients) total += gradient.NumElements();
    OP_REQUIRES(context, start >= 0 && start + total <= draws.NumElements(),
                tensorflow::errors::OutOfRange(
                    "the noise buffer holds ", draws.NumElements() - start, " unread draws and "
                    "the step needs ", total, ": a take no reserve covered"));
    tensorflow::OpOutputList noisy;
    OP_REQUIRES_OK(context, context->output_list("noisy", &noisy));
    const float* draw = draws.flat<float>().data() + start;
    for (int n = 0; n < gradients.size(); ++n) {
      Tensor* out;
      OP_REQUIRES_OK(context, noisy.allocate(n, gradients[n].shape(), &out));
      const int64_t size = gradients[n].NumElements();
      const float* in = gradients[n].flat<float>().data();
      float* out_data = out->flat<float>().data();
      ParallelFor(context, size, 1, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) out_data[k] = in[k] + draw[k];
      });
      draw += size;
    }
    Tensor* next;
    OP_REQUIRES_OK(context, context->allocate_output("next", TensorShape({}), &next));
    next->scalar<int64_t>()() = start + total;
  }
};

REGISTER_KERNEL_BUILDER(Name("AddNoise").Device(tensorflow::DEVICE_CPU), AddNoiseOp);

#define REGISTER_KERNELS(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("ConvPerExampleGradients").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      ConvPerExampleGradientsOp<T>);                                                         \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("DenseSquaredNorms").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),       \
      DenseSquaredNormsOp<T>);                                                               \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("ClippedRows").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),             \
      ClippedRowsOp<T>);                                                                     \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("KeptWeightedSum").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),         \
      KeptWeightedSumOp<T>);

REGISTER_KERNELS(float)
REGISTER_KERNELS(double)

}  // namespace sage_tfx

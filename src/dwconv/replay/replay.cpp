// Replays a recorded pass (dwconv/replay/program.py) without Python: each aten op through the
// dispatcher (a boxed call on a stack built once), each Triton launch through cuLaunchKernel on
// the cubin Triton compiled (DWCONV_CUDA_LAUNCH builds), or, for tests on the CPU, through a Python
// callable; and an autograd Function in C++ (`conv`) whose forward and backward are such programs,
// so that neither pass runs Python once a layer's programs are recorded. Built at first use by
// dwconv/replay/native.py.

#include <torch/extension.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#ifdef DWCONV_CUDA_LAUNCH
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#endif

namespace py = pybind11;

namespace {

// Error messages joined by hand, never by TORCH_CHECK's stream formatting: on the GPU machine's
// toolchain any std::ostringstream in an extension segfaults, and a
// failed check must raise. (The message is built only when the check fails.)
template <typename T>
std::string piece(const T& value) {
  if constexpr (std::is_same_v<T, char>) {
    return std::string(1, value);
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(value);
  } else {
    return std::string(value);
  }
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  (out += ... += piece(parts));
  return out;
}

#define DWCONV_CHECK(cond, ...) TORCH_CHECK(cond, message(__VA_ARGS__))

struct OpStep {
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;                       // every argument, tensors left None
  std::vector<std::pair<size_t, int64_t>> tensor_args;  // (stack position, value index)
  std::vector<int64_t> results;                         // value index of each return, -1: dropped
};

struct LaunchStep {
  std::vector<int64_t> tensors;  // value indices, in the kernel's order
  py::object callback;           // a Python launch (CPU tests), or None
  // a native launch: the CUfunction, grid, threads, shared bytes, and one parameter a kind:
  // 'p' a tensor's data pointer (values: its index into `tensors`), 'i' int32, 'l' int64, 's' null
  int64_t function = 0;
  std::vector<int64_t> grid;
  int64_t threads = 0, shared = 0;
  std::string kinds;
  std::vector<int64_t> values;
};

class Program {
 public:
  explicit Program(int64_t n_inputs) : n_inputs_(n_inputs), n_values_(n_inputs) {}

  // args: the op's every argument in schema order (tensor positions None); tensor_args name them.
  void add_op(const std::string& name, const std::string& overload, const py::list& args,
              const std::vector<std::pair<int64_t, int64_t>>& tensor_args, const std::vector<int64_t>& results) {
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = handle.schema();
    DWCONV_CHECK(args.size() == schema.arguments().size(), name, ": ", args.size(), " arguments for ",
                schema.arguments().size());
    DWCONV_CHECK(results.size() == schema.returns().size(), name, ": ", results.size(), " results for ",
                schema.returns().size());
    OpStep step{handle, {}, {}, results};
    for (size_t i = 0; i < args.size(); ++i) {
      step.stack.push_back(args[i].is_none() ? c10::IValue()
                                             : torch::jit::toIValue(args[i], schema.arguments()[i].real_type()));
    }
    for (const auto& [position, index] : tensor_args) {
      DWCONV_CHECK(position >= 0 && position < static_cast<int64_t>(args.size()) && index >= 0 && index < n_values_,
                  name, ": tensor argument ", position, " names value ", index, " of ", n_values_);
      step.tensor_args.emplace_back(static_cast<size_t>(position), index);
    }
    for (int64_t index : results) {
      DWCONV_CHECK(index == -1 || index == n_values_, name, ": results must take the next values in order");
      n_values_ += index != -1;
    }
    steps_.emplace_back(std::move(step));
  }

  void add_python_launch(py::object callback, const std::vector<int64_t>& tensors) {
    check_values(tensors);
    LaunchStep step;
    step.tensors = tensors;
    step.callback = std::move(callback);
    steps_.emplace_back(std::move(step));
  }

  void add_native_launch(int64_t function, const std::vector<int64_t>& grid, int64_t threads, int64_t shared,
                         const std::vector<int64_t>& tensors, const std::string& kinds,
                         const std::vector<int64_t>& values) {
#ifndef DWCONV_CUDA_LAUNCH
    DWCONV_CHECK(false, "this build of dwconv's replayer has no CUDA launches");
#endif
    check_values(tensors);
    DWCONV_CHECK(grid.size() == 3 && kinds.size() == values.size(), "a grid of 3 and one value a parameter");
    for (size_t i = 0; i < kinds.size(); ++i) {
      DWCONV_CHECK(std::string("pils").find(kinds[i]) != std::string::npos, "parameter kind ", kinds[i]);
      DWCONV_CHECK(kinds[i] != 'p' || (values[i] >= 0 && values[i] < static_cast<int64_t>(tensors.size())),
                  "pointer parameter ", i, " names tensor ", values[i]);
    }
    LaunchStep step;
    step.tensors = tensors;
    step.callback = py::none();
    step.function = function;
    step.grid = grid;
    step.threads = threads;
    step.shared = shared;
    step.kinds = kinds;
    step.values = values;
    steps_.emplace_back(std::move(step));
  }

  // Also plans each made value's release after the last step that reads it: a replay holding every
  // value to its end kept a weight gradient's partial sums beside grad_input, above PyTorch's peak
  // memory (the Python path frees them when the launcher returns).
  void set_outputs(const std::vector<int64_t>& outputs) {
    for (int64_t index : outputs) DWCONV_CHECK(index >= -1 && index < n_values_, "output names value ", index);
    outputs_ = outputs;
    std::vector<int64_t> last_use(n_values_, -1);
    int64_t next = n_inputs_;
    for (size_t s = 0; s < steps_.size(); ++s) {
      if (const auto* op = std::get_if<OpStep>(&steps_[s])) {
        for (const auto& [position, index] : op->tensor_args) last_use[index] = static_cast<int64_t>(s);
        for (int64_t result : op->results) {
          if (result != -1) last_use[next++] = static_cast<int64_t>(s);
        }
      } else {
        for (int64_t index : std::get<LaunchStep>(steps_[s]).tensors) last_use[index] = static_cast<int64_t>(s);
      }
    }
    for (int64_t index : outputs) {
      if (index != -1) last_use[index] = -1;
    }
    release_after_.assign(steps_.size(), {});
    for (int64_t index = n_inputs_; index < n_values_; ++index) {
      if (last_use[index] != -1) release_after_[last_use[index]].push_back(index);
    }
  }

  std::vector<std::optional<at::Tensor>> replay(const std::vector<std::optional<at::Tensor>>& inputs) const {
    DWCONV_CHECK(static_cast<int64_t>(inputs.size()) == n_inputs_, "program takes ", n_inputs_, " inputs, got ",
                inputs.size());
    std::vector<c10::IValue> values(n_values_);
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i]) values[i] = *inputs[i];
    }
    int64_t next = n_inputs_;
    for (size_t s = 0; s < steps_.size(); ++s) {
      const auto& step = steps_[s];
      if (const auto* op = std::get_if<OpStep>(&step)) {
        torch::jit::Stack stack = op->stack;
        for (const auto& [position, index] : op->tensor_args) stack[position] = values[index];
        op->op.callBoxed(stack);
        for (size_t r = 0; r < op->results.size(); ++r) {
          if (op->results[r] != -1) values[next++] = std::move(stack[r]);
        }
      } else {
        launch(std::get<LaunchStep>(step), values);
      }
      if (s < release_after_.size()) {
        for (int64_t index : release_after_[s]) values[index] = c10::IValue();
      }
    }
    std::vector<std::optional<at::Tensor>> out;
    for (int64_t index : outputs_) {
      out.push_back(index == -1 || values[index].isNone() ? std::nullopt
                                                          : std::optional<at::Tensor>(values[index].toTensor()));
    }
    return out;
  }

  int64_t steps() const { return static_cast<int64_t>(steps_.size()); }

 private:
  void check_values(const std::vector<int64_t>& tensors) const {
    for (int64_t index : tensors) DWCONV_CHECK(index >= 0 && index < n_values_, "launch names value ", index);
  }

#ifdef DWCONV_CUDA_LAUNCH
  // cuLaunchKernel needs a current context on the calling thread, which a thread that never made a
  // CUDA runtime call has not (the autograd engine's device thread replaying a backward op recorded
  // elsewhere failed with CUDA_ERROR_INVALID_CONTEXT on the H200): the device's primary context, as
  // PyTorch and Triton use, made current there.
  static void ensure_context(int device_index) {
    CUcontext context = nullptr;
    DWCONV_CHECK(cuCtxGetCurrent(&context) == CUDA_SUCCESS, "cuCtxGetCurrent failed");
    if (context != nullptr) return;
    CUdevice device;
    DWCONV_CHECK(cuDeviceGet(&device, device_index) == CUDA_SUCCESS, "cuDeviceGet failed");
    DWCONV_CHECK(cuDevicePrimaryCtxRetain(&context, device) == CUDA_SUCCESS, "cuDevicePrimaryCtxRetain failed");
    DWCONV_CHECK(cuCtxSetCurrent(context) == CUDA_SUCCESS, "cuCtxSetCurrent failed");
  }
#endif

  static void launch(const LaunchStep& step, const std::vector<c10::IValue>& values) {
    if (!step.callback.is_none()) {
      py::gil_scoped_acquire gil;
      py::list tensors;
      for (int64_t index : step.tensors) tensors.append(values[index].toTensor());
      step.callback(tensors);
      return;
    }
#ifdef DWCONV_CUDA_LAUNCH
    const at::Tensor& first = values[step.tensors.at(0)].toTensor();
    c10::cuda::CUDAGuard guard(first.device());
    ensure_context(first.get_device());
    std::vector<uint64_t> storage(step.kinds.size(), 0);
    std::vector<void*> params(step.kinds.size());
    for (size_t i = 0; i < step.kinds.size(); ++i) {
      if (step.kinds[i] == 'p') {
        storage[i] = reinterpret_cast<uint64_t>(values[step.tensors[step.values[i]]].toTensor().data_ptr());
      } else if (step.kinds[i] == 'i') {
        int32_t v = static_cast<int32_t>(step.values[i]);
        std::memcpy(&storage[i], &v, sizeof v);
      } else if (step.kinds[i] == 'l') {
        storage[i] = static_cast<uint64_t>(step.values[i]);
      }
      params[i] = &storage[i];
    }
    CUresult status = cuLaunchKernel(reinterpret_cast<CUfunction>(step.function), step.grid[0], step.grid[1],
                                     step.grid[2], step.threads, 1, 1, step.shared,
                                     c10::cuda::getCurrentCUDAStream(first.get_device()).stream(), params.data(),
                                     nullptr);
    DWCONV_CHECK(status == CUDA_SUCCESS, "cuLaunchKernel failed: ", static_cast<int>(status));
#else
    DWCONV_CHECK(false, "no CUDA launches in this build");
#endif
  }

  int64_t n_inputs_, n_values_;
  std::vector<std::variant<OpStep, LaunchStep>> steps_;
  std::vector<int64_t> outputs_;
  std::vector<std::vector<int64_t>> release_after_;  // by step: the values no later step reads
};

// A tensor as the launches must read it: a negative-bit view (torch._neg_view) is resolved, since
// the kernels read raw memory. (No copy for any other tensor.)
at::Tensor plain(const at::Tensor& t) {
  if (!t.defined()) return t;
  if (t.is_neg()) return t.resolve_neg();
  return t;
}

// What a recorded program depends on in one tensor: dtype, device, 16-byte alignment, sizes and
// strides (the recorded launches were planned and compiled for exactly these).
void append_layout(std::vector<int64_t>& key, const at::Tensor& t) {
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(static_cast<int64_t>(t.device().type()));
  key.push_back(t.device().index());
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
  key.push_back(t.dim());
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.insert(key.end(), t.strides().begin(), t.strides().end());
}

// Python objects released only with the GIL held (a layer can die on an autograd device thread), and
// never after the interpreter is gone (then they are left to the process's end).
void release_python(py::object& object) {
  if (!object) return;
  if (!Py_IsInitialized() || _Py_IsFinalizing()) {
    object.release();
    return;
  }
  py::gil_scoped_acquire gil;
  object = py::object();
}

// One layer key (shapes, strides, dtypes, conv arguments: native.py): its forward program and
// its backward programs by (wanted gradients, and the layout of each tensor the backward reads:
// for a convolution grad_out and the saved input and weight, for the fused block's BatchNorm grad
// and the saved y, weight, bias, mean and invstd; saved-tensor hooks can hand them back in another
// layout, offset or device), recorded by a Python callable on first need. A null program: that
// backward could not be recorded and runs in Python (`python_backward`), as every backward that
// builds a graph (create_graph=True) does. Held by the registry and by every autograd node of it,
// so evicting a layer never strands a graph that still needs its backward.
struct Layer : torch::CustomClassHolder {
  std::shared_ptr<Program> forward;
  py::object record_backward;  // (mask, *backward's tensors) -> Program, or None where not recordable
  py::object python_backward;  // (mask, *backward's tensors) -> [one gradient a differentiable input]
  std::mutex mutex;
  std::map<std::vector<int64_t>, std::shared_ptr<Program>> backward;
  std::atomic<int64_t> last_used{0};  // the use clock's value at its last call (native.py evicts the oldest)

  ~Layer() override {
    if (!Py_IsInitialized() || _Py_IsFinalizing()) {  // (programs may hold Python launch callbacks)
      new std::shared_ptr<Program>(std::move(forward));
      new std::map<std::vector<int64_t>, std::shared_ptr<Program>>(std::move(backward));
    } else {
      py::gil_scoped_acquire gil;
      forward.reset();
      backward.clear();
    }
    release_python(record_backward);
    release_python(python_backward);
  }

  static py::tuple arguments(int64_t mask, const std::vector<at::Tensor>& tensors) {
    py::tuple args(tensors.size() + 1);
    args[0] = py::int_(mask);
    for (size_t i = 0; i < tensors.size(); ++i) args[i + 1] = py::cast(tensors[i]);
    return args;
  }

  // nullptr: take python_backward
  std::shared_ptr<Program> backward_for(int64_t mask, const std::vector<at::Tensor>& tensors) {
    std::vector<int64_t> key{mask};
    for (const at::Tensor& t : tensors) append_layout(key, t);
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto found = backward.find(key);
      if (found != backward.end()) return found->second;
    }
    std::shared_ptr<Program> program;
    {
      py::gil_scoped_acquire gil;
      py::object recorded = record_backward(*arguments(mask, tensors));
      if (!recorded.is_none()) program = recorded.cast<std::shared_ptr<Program>>();
    }
    std::lock_guard<std::mutex> lock(mutex);
    return backward.emplace(key, program).first->second;
  }

  torch::autograd::variable_list run_python_backward(int64_t mask, const std::vector<at::Tensor>& tensors) {
    py::gil_scoped_acquire gil;
    auto grads = python_backward(*arguments(mask, tensors)).cast<std::vector<std::optional<at::Tensor>>>();
    torch::autograd::variable_list out(3);
    for (size_t i = 0; i < 3 && i < grads.size(); ++i) {
      if (grads[i]) out[i] = *grads[i];
    }
    return out;
  }

  // One pass of a layer whose backward is several passes by mask (the squeeze-and-excitation
  // block's), never differentiable: its program, or python_backward's one result where none could be
  // recorded.
  at::Tensor run_pass(int64_t mask, std::vector<at::Tensor> tensors) {
    for (auto& t : tensors) t = plain(t);
    auto program = backward_for(mask, tensors);
    if (!program) {
      py::gil_scoped_acquire gil;
      return python_backward(*arguments(mask, tensors)).cast<at::Tensor>();
    }
    std::vector<std::optional<at::Tensor>> inputs(tensors.begin(), tensors.end());
    auto result = program->replay(inputs);
    DWCONV_CHECK(!result.empty() && result[0], "a pass's result");
    return *result[0];
  }

  // The backward's gradients (undefined where not wanted): its program's, or Python's where the
  // graph is built again (create_graph) or no program could be recorded.
  torch::autograd::variable_list run_backward(int64_t mask, std::vector<at::Tensor> tensors) {
    if (at::GradMode::is_enabled()) return run_python_backward(mask, tensors);
    for (auto& t : tensors) t = plain(t);
    auto program = backward_for(mask, tensors);
    if (!program) return run_python_backward(mask, tensors);
    std::vector<std::optional<at::Tensor>> inputs(tensors.begin(), tensors.end());
    auto result = program->replay(inputs);
    torch::autograd::variable_list out(3);
    for (size_t i = 0; i < 3 && i < result.size(); ++i) {
      if (result[i] && (mask >> i & 1)) out[i] = *result[i];
    }
    return out;
  }
};

// The layers by number, as native.py registers and evicts them (its bounded LRU), and the calls
// known to run them: a call's tensors' layouts and the spelling of its arguments -> layer number.
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, c10::intrusive_ptr<Layer>> layers;
  int64_t next = 0;
  std::shared_mutex calls_mutex;
  std::unordered_map<std::string, int64_t> calls;
};

std::atomic<int64_t> use_clock{0};

Registry& registry() {
  // never destroyed: its layers' Python callables must not be released after the interpreter has finalized
  static auto* instance = new Registry();
  return *instance;
}

int64_t register_layer(std::shared_ptr<Program> forward, py::object record_backward, py::object python_backward) {
  auto layer = c10::make_intrusive<Layer>();
  layer->forward = std::move(forward);
  layer->record_backward = std::move(record_backward);
  layer->python_backward = std::move(python_backward);
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.layers.emplace(reg.next, std::move(layer));
  return reg.next++;
}

c10::intrusive_ptr<Layer> find_layer(int64_t number) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto found = reg.layers.find(number);
  return found == reg.layers.end() ? c10::intrusive_ptr<Layer>() : found->second;
}

void release_layer(int64_t number) {
  c10::intrusive_ptr<Layer> layer;  // (dropped after the registry's lock: its destructor takes the GIL)
  auto& reg = registry();
  {
    std::unique_lock<std::shared_mutex> lock(reg.calls_mutex);
    for (auto it = reg.calls.begin(); it != reg.calls.end();) {
      it = it->second == number ? reg.calls.erase(it) : std::next(it);
    }
  }
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto found = reg.layers.find(number);
  if (found != reg.layers.end()) {
    layer = std::move(found->second);
    reg.layers.erase(found);
  }
}

// The use clock's value at the layer's last call, -1 for no such layer.
int64_t last_used(int64_t number) {
  auto layer = find_layer(number);
  return layer ? layer->last_used.load() : -1;
}

// The use clock, advanced (native.py stamps the layers that take the Python path with it).
int64_t tick() { return ++use_clock; }

int64_t layer_count() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  return static_cast<int64_t>(reg.layers.size());
}

// The passes of an autograd Function, with or without a bias argument (an undefined tensor in its
// place is not accepted by torch::autograd::Function::apply).
at::Tensor forward_pass(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, const c10::intrusive_ptr<Layer>& layer) {
  ctx->saved_data["layer"] = c10::IValue::make_capsule(layer);
  ctx->save_for_backward({input, weight});  // only these, as the Python Function
  return *layer->forward->replay({input, weight, bias}).at(0);
}

// grads of input, weight and bias (undefined where not wanted); mask bits: 1 input, 2 weight, 4 bias
torch::autograd::variable_list backward_pass(torch::autograd::AutogradContext* ctx, const at::Tensor& grad_out,
                                             int64_t mask) {
  auto saved = ctx->get_saved_variables();
  auto layer = c10::static_intrusive_pointer_cast<Layer>(ctx->saved_data["layer"].toCapsule());
  return layer->run_backward(mask, {grad_out, saved[0], saved[1]});
}

int64_t wanted(torch::autograd::AutogradContext* ctx, bool has_bias) {
  return (ctx->needs_input_grad(0) ? 1 : 0) | (ctx->needs_input_grad(1) ? 2 : 0) |
         (has_bias && ctx->needs_input_grad(2) ? 4 : 0);
}

class ConvFunction : public torch::autograd::Function<ConvFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::intrusive_ptr<Layer>& layer) {
    return forward_pass(ctx, input, weight, std::nullopt, layer);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto out = backward_pass(ctx, grads[0], wanted(ctx, false));
    return {out[0], out[1], at::Tensor()};
  }
};

class ConvBiasFunction : public torch::autograd::Function<ConvBiasFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, const c10::intrusive_ptr<Layer>& layer) {
    return forward_pass(ctx, input, weight, bias, layer);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto out = backward_pass(ctx, grads[0], wanted(ctx, true));
    return {out[0], out[1], out[2], at::Tensor()};
  }
};

// None where the layer has been evicted meanwhile (the caller takes the full path).
std::optional<at::Tensor> conv(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, int64_t number) {
  auto layer = find_layer(number);
  if (!layer) return std::nullopt;
  layer->last_used = ++use_clock;
  return bias ? ConvBiasFunction::apply(input, weight, *bias, layer) : ConvFunction::apply(input, weight, layer);
}

// The fused block's BatchNorm in training with its activation (dwconv/batch_norm.py's Function, from
// C++): forward, the program (y, weight, bias, running_mean, running_var) -> (out, mean, invstd),
// the running statistics updated in place; saved: y, weight, bias and the batch's statistics.
class NormFunction : public torch::autograd::Function<NormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                            const c10::intrusive_ptr<Layer>& layer) {
    ctx->saved_data["layer"] = c10::IValue::make_capsule(layer);
    auto results = layer->forward->replay({y, weight, bias, running_mean, running_var});
    DWCONV_CHECK(results.size() == 3 && results[0] && results[1] && results[2], "a BatchNorm forward's results");
    ctx->save_for_backward({y, weight, bias, *results[1], *results[2]});
    return *results[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto layer = c10::static_intrusive_pointer_cast<Layer>(ctx->saved_data["layer"].toCapsule());
    auto out = layer->run_backward(wanted(ctx, true), {grads[0], saved[0], saved[1], saved[2], saved[3], saved[4]});
    return {out[0], out[1], out[2], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// None where the layer has been evicted meanwhile (the caller takes its Python Function).
std::optional<at::Tensor> norm(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& running_mean, const at::Tensor& running_var, int64_t number) {
  auto layer = find_layer(number);
  if (!layer) return std::nullopt;
  layer->last_used = ++use_clock;
  return NormFunction::apply(y, weight, bias, running_mean, running_var, layer);
}

// A tensor the replayer may take: not a tensor subclass that dispatches in Python (its own
// __torch_dispatch__ must see the call), and one with storage to read.
bool replayable(const at::Tensor& t) {
  return t.defined() && !t.key_set().has(c10::DispatchKey::Python) && t.has_storage();
}

// The squeeze-and-excitation block in training (dwconv/squeeze_excite.py): out = input *
// gate(squeeze(input)) as two autograd nodes written in C++ around the gate's own ops, which stay in
// the caller's graph: SqueezeFunction (the mean over H and W) and ScaleFunction (the gate's
// multiply, the layer's forward program (input, gate rows) -> out). No Python runs in the backward
// and no nested backward is started (the Python Function's host cost: about 0.44 ms a block on an
// H100's host). The input's gradient, grad * gate + the squeeze's gradient / (H * W), is one pass
// where autograd would add two whole tensors: ScaleFunction's backward hands grad and the gate rows
// to the squeeze's node, whose backward runs after the gate's graph has given it the squeeze's
// gradient and computes both terms. They are handed over by graph task, since two threads may
// differentiate one retained graph at once. A backward that builds a graph (create_graph=True) takes
// each node's own differentiable formula instead, and autograd adds them. The layer's passes, by
// mask: 1 the input's gradient (grad, gate rows, the squeeze's gradient rows), 2 the gate's gradient
// (grad, input), both in the input's dtype.
struct ExciteState : torch::CustomClassHolder {
  c10::intrusive_ptr<Layer> layer;
  std::mutex mutex;
  std::map<int, std::pair<at::Tensor, at::Tensor>> handed;  // graph task -> (grad, gate rows)

  void hand(at::Tensor grad, at::Tensor gate_rows) {
    std::lock_guard<std::mutex> lock(mutex);
    handed[torch::autograd::get_current_graph_task_id()] = {std::move(grad), std::move(gate_rows)};
  }

  std::optional<std::pair<at::Tensor, at::Tensor>> take() {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = handed.find(torch::autograd::get_current_graph_task_id());
    if (found == handed.end()) return std::nullopt;
    auto out = std::move(found->second);
    handed.erase(found);
    return out;
  }
};

c10::intrusive_ptr<ExciteState> excite_state(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<ExciteState>(ctx->saved_data["state"].toCapsule());
}

// [N, C] contiguous and 16-byte aligned (as the programs were recorded for) from a [N, C, 1, 1] tensor.
at::Tensor channel_rows(const at::Tensor& t) {
  auto rows = plain(t).reshape({t.size(0), t.size(1)}).contiguous();
  return reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 ? rows : rows.clone();
}

class SqueezeFunction : public torch::autograd::Function<SqueezeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, bool pool,
                            const c10::intrusive_ptr<ExciteState>& state) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    ctx->saved_data["sizes"] = input.sizes().vec();
    return pool ? at::adaptive_avg_pool2d(input, {1, 1}) : input.mean({2, 3}, true);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto sizes = ctx->saved_data["sizes"].toIntVector();
    if (!at::GradMode::is_enabled()) {
      auto state = excite_state(ctx);
      if (auto handed = state->take()) {
        auto shift = channel_rows(grads[0]);
        return {state->layer->run_pass(1, {handed->first, handed->second, shift}), at::Tensor(), at::Tensor()};
      }
    }
    return {grads[0].expand(sizes) / static_cast<double>(sizes[2] * sizes[3]), at::Tensor(), at::Tensor()};
  }
};

class ScaleFunction : public torch::autograd::Function<ScaleFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& gate,
                            const c10::intrusive_ptr<ExciteState>& state) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    ctx->save_for_backward({input, gate});
    auto results = state->layer->forward->replay({plain(input), channel_rows(gate)});
    DWCONV_CHECK(!results.empty() && results[0], "a squeeze-and-excitation forward's result");
    return *results[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& gate = saved[1];
    at::Tensor grad = grads[0], grad_input, grad_gate;
    if (at::GradMode::is_enabled()) {
      if (ctx->needs_input_grad(0)) grad_input = grad * gate;
      if (ctx->needs_input_grad(1)) grad_gate = (grad * input).sum({2, 3}, true);
      return {grad_input, grad_gate, at::Tensor()};
    }
    // (grad and the input in one layout the passes read: channels_last wherever the input is so; a
    // saved-tensor hook may hand the input back in any)
    auto layout = input.is_contiguous(at::MemoryFormat::ChannelsLast) ? at::MemoryFormat::ChannelsLast
                                                                       : at::MemoryFormat::Contiguous;
    grad = plain(grad).contiguous(layout);
    auto state = excite_state(ctx);
    if (ctx->needs_input_grad(1)) {
      grad_gate = state->layer->run_pass(2, {grad, plain(input).contiguous(layout)}).reshape(gate.sizes());
    }
    if (ctx->needs_input_grad(0)) state->hand(grad, channel_rows(gate));  // (the squeeze's node adds its term)
    return {at::Tensor(), grad_gate, at::Tensor()};
  }
};

// The block's output: the squeeze's node, gate_of (the members' calls, from Python) on it, then the
// multiply's node for a gate the launches read (a plain tensor of the input's dtype and device,
// [N, C, 1, 1]), else Python's `input * gate` (the squeeze's node then differentiates as the mean).
// None where the layer has been evicted meanwhile (the caller takes its Python Function).
py::object squeeze_excite(const at::Tensor& input, const py::object& gate_of, bool pool, int64_t number) {
  auto layer = find_layer(number);
  if (!layer) return py::none();
  layer->last_used = ++use_clock;
  auto state = c10::make_intrusive<ExciteState>();
  state->layer = layer;
  py::object gate_object = gate_of(SqueezeFunction::apply(input, pool, state));
  if (THPVariable_CheckExact(gate_object.ptr())) {
    const at::Tensor& gate = THPVariable_Unpack(gate_object.ptr());
    if (replayable(gate) && gate.scalar_type() == input.scalar_type() && gate.device() == input.device() &&
        gate.dim() == 4 && gate.size(0) == input.size(0) && gate.size(1) == input.size(1) && gate.size(2) == 1 &&
        gate.size(3) == 1) {
      return py::cast(ScaleFunction::apply(input, gate, state));
    }
  }
  PyObject* product = PyNumber_Multiply(py::cast(input).ptr(), gate_object.ptr());
  if (product == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(product);
}

// A known call's key: each tensor's layout (as program_key: append_layout and the negative bit; an
// absent bias a marker) and the spelling of the arguments. None for tensors the replayer must not
// take (replayable).
std::optional<std::string> call_key(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, const std::string& spelling) {
  std::vector<int64_t> key;
  for (const at::Tensor* t : {&input, &weight, bias ? &*bias : nullptr}) {
    if (t == nullptr) {
      key.push_back(-1);
      continue;
    }
    if (!replayable(*t)) return std::nullopt;
    append_layout(key, *t);
    key.push_back(t->is_neg());
  }
  std::string out(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
  return out + spelling;
}

// The layer a call of these tensors, spelled so, was recorded for (native.py's conv_known): a call
// known before runs here without Python past the arguments' spelling.
void remember_call(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   const std::string& spelling, int64_t number) {
  auto key = call_key(input, weight, bias, spelling);
  if (!key) return;
  auto& reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.calls_mutex);
  reg.calls[*key] = number;
}

// The layouts of these tensors as one key (append_layout and the negative bit each; an absent one a
// marker), none where the replayer must not take one (replayable): the key of a replayed block's
// programs (block_replay.py), of a fused BatchNorm's layer and of a replayed pass (native.py) in one
// call from Python, where program_key took 0.5-1.2 us a tensor.
std::optional<py::bytes> layouts_key(const std::vector<std::optional<at::Tensor>>& tensors) {
  std::vector<int64_t> key;
  key.reserve(tensors.size() * 12);
  for (const auto& t : tensors) {
    if (!t) {
      key.push_back(-1);
      continue;
    }
    if (!replayable(*t)) return std::nullopt;
    append_layout(key, *t);
    key.push_back(t->is_neg());
  }
  return py::bytes(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
}

// conv for a call remembered before, None for any other (the caller takes the full path). Under
// autocast, first the casts F.conv2d's autocast makes, by its own function (cached_cast: the same
// eligibility, and the same cache of a float32 leaf weight's cast within the autocast region): from
// Python, a weight's cast cost 14 of a converted layer's 50 us of host time on the H200's host.
// Where it casts other than the full path's functional._autocast (a tensor on another device),
// the key was never remembered: the lookup misses, and the full path decides.
std::optional<at::Tensor> conv_known(const at::Tensor& input_, const at::Tensor& weight_,
                                     const std::optional<at::Tensor>& bias_, const std::string& spelling) {
  if (!replayable(input_) || !replayable(weight_) || (bias_ && !replayable(*bias_))) {
    return std::nullopt;  // (before any cast: a subclass would see it)
  }
  const auto device_type = input_.device().type();
  at::Tensor input = input_, weight = weight_;
  std::optional<at::Tensor> bias = bias_;
  if (at::autocast::is_autocast_enabled(device_type)) {
    const auto dtype = at::autocast::get_autocast_dtype(device_type);
    input = at::autocast::cached_cast(dtype, input, device_type);
    weight = at::autocast::cached_cast(dtype, weight, device_type);
    bias = at::autocast::cached_cast(dtype, bias, device_type);
  }
  auto key = call_key(input, weight, bias, spelling);
  if (!key) return std::nullopt;
  int64_t number;
  {
    auto& reg = registry();
    std::shared_lock<std::shared_mutex> lock(reg.calls_mutex);
    auto found = reg.calls.find(*key);
    if (found == reg.calls.end()) return std::nullopt;
    number = found->second;
  }
  return conv(input, weight, bias, number);
}

// ---- the registered ops (dwconv/_library.py) served from here ------------------------------------

// torch.compile's graphs call dwconv's registered ops once a pass; their Python implementation cost
// 184 us of host time a MobileNetV2 layer on the H200's host (under the profiler; cuDNN's call 37).
// On the dispatch keys `serve_ops` names, an op's implementation is `served_op`: a call whose
// tensors' layouts and other arguments were seen before replays the program recorded for it; any
// other call goes to Python (`miss`), which runs the op's Python implementation, recorded where it
// can be.
struct ServedOps {
  std::shared_mutex mutex;
  std::unordered_map<std::string, std::shared_ptr<Program>> programs;  // nullptr: that call runs in Python
  size_t capacity = 0;
  py::object miss;  // (op name, [arguments], record) -> (result, Program or None)
  py::object autograd;  // (op name, raw dispatch key set, [arguments]) -> result: the ops' differentiable calls
  std::vector<std::unique_ptr<torch::Library>> registrations;  // (released: the Python implementations again)
};

ServedOps& served_ops() {
  static auto* instance = new ServedOps();  // (never destroyed: it holds a Python callable)
  return *instance;
}

bool tensor_argument(const c10::Argument& argument) {
  const auto& type = argument.real_type();
  return type->kind() == c10::TypeKind::TensorType ||
         (type->kind() == c10::TypeKind::OptionalType &&
          type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType);
}

// The call's key (the op, each tensor's layout, every other argument's value) and its tensors in the
// schema's order (an absent optional one: nullopt); none for a call only Python may run: a tensor
// subclass or a negative-bit view (the implementation resolves it), an argument of another kind, or
// a dispatch mode on the stack (it must see the implementation's ops).
std::optional<std::string> served_key(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                      std::vector<std::optional<at::Tensor>>& tensors) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return std::nullopt;
  std::vector<int64_t> key;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& arg = args[i];
    if (tensor_argument(schema.arguments()[i])) {
      if (arg.isNone()) {
        key.push_back(-1);
        tensors.emplace_back(std::nullopt);
        continue;
      }
      const at::Tensor& t = arg.toTensor();
      if (!replayable(t) || t.is_neg()) return std::nullopt;
      append_layout(key, t);
      tensors.emplace_back(t);
    } else if (arg.isIntList()) {
      const auto values = arg.toIntList();
      key.push_back(static_cast<int64_t>(values.size()));
      for (int64_t v : values) key.push_back(v);
    } else if (arg.isBool() || arg.isInt()) {
      key.push_back(arg.isBool() ? arg.toBool() : arg.toInt());
    } else if (arg.isDouble()) {  // (by its bits: the recorded program holds the value itself)
      const double value = arg.toDouble();
      int64_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      key.push_back(bits);
    } else {
      return std::nullopt;
    }
  }
  return schema.operator_name().name + "." + schema.overload_name() + ":" +
         std::string(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
}

void push_results(const c10::FunctionSchema& schema, const std::vector<std::optional<at::Tensor>>& results,
                  torch::jit::Stack* stack) {
  const auto& returns = schema.returns();
  if (returns.size() == 1 && returns[0].real_type()->kind() == c10::TypeKind::ListType) {
    c10::List<at::Tensor> list;
    for (const auto& result : results) list.push_back(*result);
    stack->emplace_back(std::move(list));
    return;
  }
  DWCONV_CHECK(results.size() == returns.size(), schema.name(), ": ", results.size(), " results for ",
               returns.size());
  for (const auto& result : results) stack->emplace_back(result ? c10::IValue(*result) : c10::IValue());
}

py::list python_arguments(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  py::list args;
  for (const auto& arg : torch::jit::last(stack, schema.arguments().size())) args.append(torch::jit::toPyObject(arg));
  return args;
}

void push_python_result(const c10::FunctionSchema& schema, const py::object& result, torch::jit::Stack* stack) {
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(result, returns[0].real_type()));
    return;
  }
  auto results = result.cast<py::sequence>();
  for (size_t i = 0; i < returns.size(); ++i) {
    stack->push_back(torch::jit::toIValue(results[i], returns[i].real_type()));
  }
}

void run_in_python(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const std::optional<std::string>& key) {
  auto& served = served_ops();
  const size_t n = schema.arguments().size();
  py::gil_scoped_acquire gil;
  py::tuple answer = served.miss(schema.name(), python_arguments(schema, *stack), key.has_value());
  if (key) {
    std::shared_ptr<Program> program;
    if (!answer[1].is_none()) program = answer[1].cast<std::shared_ptr<Program>>();
    std::unique_lock<std::shared_mutex> lock(served.mutex);
    if (served.programs.size() >= served.capacity) served.programs.clear();  // (recorded again as needed)
    served.programs.emplace(*key, std::move(program));
  }
  torch::jit::drop(*stack, n);
  push_python_result(schema, answer[0], stack);
}

void served_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  std::vector<std::optional<at::Tensor>> tensors;
  auto key = served_key(schema, torch::jit::last(*stack, schema.arguments().size()), tensors);
  std::shared_ptr<Program> program;
  bool known = false;
  if (key) {
    auto& served = served_ops();
    std::shared_lock<std::shared_mutex> lock(served.mutex);
    auto found = served.programs.find(*key);
    if (found != served.programs.end()) {
      known = true;
      program = found->second;
    }
  }
  if (!program) {  // (a call seen before that could not be recorded runs in Python again, unrecorded)
    run_in_python(schema, stack, known ? std::nullopt : key);
    return;
  }
  auto results = program->replay(tensors);
  torch::jit::drop(*stack, schema.arguments().size());
  push_results(schema, results, stack);
}

// The ops' autograd kernel: a call that needs no gradient (torch.compile's graphs run theirs with
// gradients off: autograd is the compiled graph's own) goes below autograd here, as the Python
// autograd kernel it replaces does, without its Python (7 of a served call's 12.7 us on the CPU
// machine); a differentiable call takes that Python (`autograd`).
void served_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  bool differentiable = false;
  if (at::GradMode::is_enabled()) {
    for (const auto& arg : torch::jit::last(*stack, schema.arguments().size())) {
      differentiable = differentiable || (arg.isTensor() && arg.toTensor().requires_grad());
    }
  }
  if (!differentiable) {
    at::AutoDispatchBelowAutograd guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    return;
  }
  auto& served = served_ops();
  py::gil_scoped_acquire gil;
  py::object result = served.autograd(schema.name(), keys.raw_repr(), python_arguments(schema, *stack));
  torch::jit::drop(*stack, schema.arguments().size());
  push_python_result(schema, result, stack);
}

// Serves the ops namespace::names on each dispatch key (as "CUDA", "CPU") from `served_op`, with
// `miss` for the calls it cannot replay; at most `capacity` programs are kept. With an `autograd`
// callable (not None), also the ops' autograd kernel on the matching Autograd key ("AutogradCUDA").
void serve_ops(const std::string& ns, const std::vector<std::string>& names, const std::vector<std::string>& keys,
               py::object miss, py::object autograd, int64_t capacity) {
  auto& served = served_ops();
  std::unique_lock<std::shared_mutex> lock(served.mutex);
  served.miss = std::move(miss);
  served.capacity = static_cast<size_t>(std::max<int64_t>(capacity, 1));
  const bool with_autograd = !autograd.is_none();
  if (with_autograd) served.autograd = std::move(autograd);
  for (const auto& key : keys) {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::parseDispatchKey(key), __FILE__,
                                                    __LINE__);
    for (const auto& name : names) library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&served_op>());
    served.registrations.push_back(std::move(library));
    if (!with_autograd) continue;
    library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::parseDispatchKey("Autograd" + key),
                                               __FILE__, __LINE__);
    for (const auto& name : names) {
      library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&served_autograd>());
    }
    served.registrations.push_back(std::move(library));
  }
}

// The registrations released (the ops' Python implementations take every call again) and the
// programs forgotten.
void stop_serving_ops() {
  auto& served = served_ops();
  std::vector<std::unique_ptr<torch::Library>> registrations;
  {
    std::unique_lock<std::shared_mutex> lock(served.mutex);
    registrations.swap(served.registrations);
    served.programs.clear();
  }
}

int64_t served_programs() {
  auto& served = served_ops();
  std::shared_lock<std::shared_mutex> lock(served.mutex);
  int64_t count = 0;
  for (const auto& entry : served.programs) count += entry.second != nullptr;
  return count;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_layer", &register_layer);
  m.def("release_layer", &release_layer);
  m.def("layer_count", &layer_count);
  m.def("conv", &conv);
  m.def("norm", &norm);
  m.def("squeeze_excite", &squeeze_excite);
  m.def("conv_known", &conv_known);
  m.def("layouts_key", &layouts_key);
  m.def("remember_call", &remember_call);
  m.def("last_used", &last_used);
  m.def("tick", &tick);
  m.def("serve_ops", &serve_ops);
  m.def("stop_serving_ops", &stop_serving_ops);
  m.def("served_programs", &served_programs);
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init<int64_t>())
      .def("add_op", &Program::add_op)
      .def("add_python_launch", &Program::add_python_launch)
      .def("add_native_launch", &Program::add_native_launch)
      .def("set_outputs", &Program::set_outputs)
      .def("replay", &Program::replay)
      .def("steps", &Program::steps);
}

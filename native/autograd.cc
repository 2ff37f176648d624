// Autograd: backward, .grad access, grad mode, the two hooks that call JS during backward (a
// tensor's gradient hook, and the post hook on a parameter's gradient accumulator), and custom
// function nodes whose backward is a JS function (src/tensor/function.ts decides what it computes).
#include "common.h"

#include <ATen/ATen.h>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <unordered_map>

namespace flotilla {

using torch::autograd::variable_list;

// Hooks run on the thread that called backward. On CPU that is the JS thread (checked here on
// every call): calling JS from any other thread would be undefined behaviour, so refuse loudly.
static void CheckHookThread(const char* what) {
  if (std::this_thread::get_id() != main_thread) {
    throw std::runtime_error(std::string(what) + " fired off the JS thread; hooks need CPU backward called from JS");
  }
}

// Calls a JS function; a JS exception becomes a C++ exception that the autograd engine carries
// back to the backward() caller, where it is rethrown as a JS error with the same message.
static Napi::Value CallJs(Napi::Env env, Napi::FunctionReference& fn, const std::vector<napi_value>& args) {
  try {
    return fn.Call(args);
  } catch (const Napi::Error& e) {
    throw std::runtime_error(e.Message());
  }
}

static Napi::Value Backward(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  Napi::Array roots = info[0].As<Napi::Array>();
  variable_list tensors, grads;
  for (uint32_t i = 0; i < roots.Length(); ++i) tensors.push_back(TensorHandle::Get(roots.Get(i)));
  if (info.Length() > 1 && info[1].IsArray()) {
    Napi::Array g = info[1].As<Napi::Array>();
    for (uint32_t i = 0; i < g.Length(); ++i) grads.push_back(TensorHandle::Get(g.Get(i)));
  }
  bool retain = info.Length() > 2 && info[2].IsBoolean() && info[2].As<Napi::Boolean>().Value();
  // inputs: accumulate only into these tensors' .grad; the engine then runs only the nodes on a
  // path to them, and generated nodes skip outputs nobody needs (should_compute_output), so
  // weight-gradient kernels of parameters left out are not run at all.
  variable_list inputs;
  if (info.Length() > 3 && info[3].IsArray()) {
    Napi::Array in = info[3].As<Napi::Array>();
    for (uint32_t i = 0; i < in.Length(); ++i) inputs.push_back(TensorHandle::Get(in.Get(i)));
    TORCH_CHECK(!inputs.empty(), "backward: inputs, when given, must name at least one tensor");
  }
  torch::autograd::backward(tensors, grads, retain, false, inputs);
  return env.Undefined();
  FLOTILLA_CATCH(env, "backward")
}

// grad(outputs, inputs, gradOutputs?, retainGraph?, allowUnused?): the gradients of outputs with
// respect to inputs, returned (not accumulated into .grad); undefined for an unused input.
static Napi::Value Grad(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  Napi::Array outs = info[0].As<Napi::Array>();
  Napi::Array ins = info[1].As<Napi::Array>();
  variable_list outputs, inputs, grads;
  for (uint32_t i = 0; i < outs.Length(); ++i) outputs.push_back(TensorHandle::Get(outs.Get(i)));
  for (uint32_t i = 0; i < ins.Length(); ++i) inputs.push_back(TensorHandle::Get(ins.Get(i)));
  if (info.Length() > 2 && info[2].IsArray()) {
    Napi::Array g = info[2].As<Napi::Array>();
    for (uint32_t i = 0; i < g.Length(); ++i) grads.push_back(TensorHandle::Get(g.Get(i)));
  }
  bool retain = info.Length() > 3 && info[3].IsBoolean() && info[3].As<Napi::Boolean>().Value();
  bool allowUnused = info.Length() > 4 && info[4].IsBoolean() && info[4].As<Napi::Boolean>().Value();
  variable_list res = torch::autograd::grad(outputs, inputs, grads, retain, false, allowUnused);
  return WrapTensors(env, res);
  FLOTILLA_CATCH(env, "grad")
}

static Napi::Value GetGrad(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  const at::Tensor& g = t.grad();
  if (!g.defined()) return env.Undefined();
  return TensorHandle::Wrap(env, g);
  FLOTILLA_CATCH(env, "grad")
}

// setGrad(t, g | undefined): g may be a view into a flat buffer; backward then accumulates in place.
static Napi::Value SetGrad(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor& t = TensorHandle::Get(info[0]);
  if (info[1].IsUndefined() || info[1].IsNull()) {
    t.mutable_grad().reset();
  } else {
    const at::Tensor& g = TensorHandle::Get(info[1]);
    TORCH_CHECK(g.sizes() == t.sizes(), "grad shape ", DescribeTensor(g), " does not match tensor ", DescribeTensor(t));
    TORCH_CHECK(g.scalar_type() == t.scalar_type(), "grad dtype ", DescribeTensor(g), " does not match tensor ", DescribeTensor(t));
    t.mutable_grad() = g;
  }
  return env.Undefined();
  FLOTILLA_CATCH(env, "setGrad")
}

static Napi::Value SetRequiresGrad(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  TensorHandle::Get(info[0]).set_requires_grad(info[1].As<Napi::Boolean>().Value());
  return env.Undefined();
  FLOTILLA_CATCH(env, "requiresGrad_")
}

static Napi::Value SetGradEnabled(const Napi::CallbackInfo& info) {
  bool prev = c10::GradMode::is_enabled();
  c10::GradMode::set_enabled(info[0].As<Napi::Boolean>().Value());
  return Napi::Boolean::New(info.Env(), prev);
}

static Napi::Value IsGradEnabled(const Napi::CallbackInfo& info) {
  return Napi::Boolean::New(info.Env(), c10::GradMode::is_enabled());
}

static Napi::Value GradFnName(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  if (!t.grad_fn()) return env.Undefined();
  return Napi::String::New(env, t.grad_fn()->name());
  FLOTILLA_CATCH(env, "gradFn")
}

// ---------------------------------------------------------------------------------------------
// Tensor gradient hook: fn(grad) may return a replacement gradient tensor.

static Napi::Value RegisterHook(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor& t = TensorHandle::Get(info[0]);
  auto fn = std::make_shared<Napi::FunctionReference>(Napi::Persistent(info[1].As<Napi::Function>()));
  unsigned pos = t.register_hook([env, fn](const at::Tensor& grad) -> at::Tensor {
    CheckHookThread("tensor hook");
    Napi::HandleScope scope(env);
    Napi::Value arg = TensorHandle::Wrap(env, grad);
    Napi::Value ret = CallJs(env, *fn, {arg});
    if (TensorHandle::IsHandle(ret)) return TensorHandle::Get(ret);
    return at::Tensor();
  });
  return Napi::Number::New(env, pos);
  FLOTILLA_CATCH(env, "registerHook")
}

static Napi::Value RemoveHook(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  TensorHandle::Get(info[0]).remove_hook(info[1].As<Napi::Number>().Uint32Value());
  return env.Undefined();
  FLOTILLA_CATCH(env, "removeHook")
}

// ---------------------------------------------------------------------------------------------
// Gradient-accumulator post hook: "this parameter's .grad now holds this backward's contribution".

struct JsPostHook : public torch::autograd::FunctionPostHook {
  JsPostHook(Napi::Env env, std::shared_ptr<Napi::FunctionReference> fn, std::shared_ptr<bool> alive)
      : env_(env), fn_(std::move(fn)), alive_(std::move(alive)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (!*alive_) return outputs;
    CheckHookThread("accumulate-grad hook");
    Napi::HandleScope scope(env_);
    CallJs(env_, *fn_, {});
    return outputs;
  }
  Napi::Env env_;
  std::shared_ptr<Napi::FunctionReference> fn_;
  std::shared_ptr<bool> alive_;
};

struct AccHookEntry {
  // The variable holds its accumulator weakly; holding it here keeps the hook alive.
  std::shared_ptr<torch::autograd::Node> accumulator;
  std::shared_ptr<bool> alive;
  std::shared_ptr<Napi::FunctionReference> fn;
};
static std::unordered_map<uint32_t, AccHookEntry> acc_hooks;
static uint32_t next_acc_hook = 1;

static Napi::Value RegisterAccumulateGradHook(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor& t = TensorHandle::Get(info[0]);
  TORCH_CHECK(t.is_leaf() && t.requires_grad(), "accumulate-grad hooks need a leaf tensor that requires grad, got ",
              DescribeTensor(t));
  auto acc = torch::autograd::impl::grad_accumulator(t);
  TORCH_CHECK(acc, "tensor has no gradient accumulator");
  auto fn = std::make_shared<Napi::FunctionReference>(Napi::Persistent(info[1].As<Napi::Function>()));
  auto alive = std::make_shared<bool>(true);
  acc->add_post_hook(std::make_unique<JsPostHook>(env, fn, alive));
  uint32_t id = next_acc_hook++;
  acc_hooks[id] = AccHookEntry{acc, alive, fn};
  return Napi::Number::New(env, id);
  FLOTILLA_CATCH(env, "registerAccumulateGradHook")
}

static Napi::Value RemoveAccumulateGradHook(const Napi::CallbackInfo& info) {
  uint32_t id = info[0].As<Napi::Number>().Uint32Value();
  auto it = acc_hooks.find(id);
  if (it != acc_hooks.end()) {
    // The post hook stays on the accumulator (libtorch has no removal), inert; release the JS
    // function now so whatever it closes over can be collected.
    *it->second.alive = false;
    it->second.fn->Reset();
    acc_hooks.erase(it);
  }
  return info.Env().Undefined();
}

// ---------------------------------------------------------------------------------------------
// End-of-backward callback: queued from inside a hook, it runs once the current backward pass has
// finished (on CPU, on the thread that called backward), so a reducer can flush what is left.

static Napi::Value QueueBackwardCallback(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  auto fn = std::make_shared<Napi::FunctionReference>(Napi::Persistent(info[0].As<Napi::Function>()));
  torch::autograd::Engine::get_default_engine().queue_callback([env, fn]() {
    CheckHookThread("end-of-backward callback");
    Napi::HandleScope scope(env);
    CallJs(env, *fn, {});
  });
  return env.Undefined();
  FLOTILLA_CATCH(env, "queueBackwardCallback")
}


// ---------------------------------------------------------------------------------------------
// Custom function node: a torch::autograd::Node whose apply calls a JS backward synchronously.
//
// [Note: native function node] functionNode(name, inputs, outputs, saved, backward) gives each
// output a new tensor on the same storage (.data-like: no autograd history, a version counter of
// its own) whose grad_fn is this node; its edges go to the inputs. The outputs are therefore the
// forward's own memory, views of another buffer included: a later free or reallocation of that
// storage is seen by every tensor autograd saved from them. The node holds the saved tensors and
// frees them when the engine releases the graph (or with the node), never the outputs.
// apply calls backward(grads, wanted, saved, last):
//   grads   one per output, a handle or undefined (the output took no part in this pass);
//   wanted  one per input, whether this pass computes that input's gradient (false for an edge the
//           engine trimmed because backward was given `inputs`);
//   saved   handles of the saved tensors;
//   last    the engine frees the node's graph after this call (no retained graph);
// and takes one handle or undefined per input in return (read, not released: they stay JS's). The
// handles passed in are released after the call.

static std::atomic<bool> env_alive{true};

struct JsFunctionNode : public torch::autograd::Node {
  JsFunctionNode(Napi::Env env, std::string name, Napi::Function fn, torch::autograd::edge_list&& edges,
                 std::vector<at::Tensor>&& saved)
      : Node(std::move(edges)), env_(env), name_(std::move(name)), fn_(Napi::Persistent(fn)), saved_(std::move(saved)) {}

  ~JsFunctionNode() override { DropJs(); }

  std::string name() const override { return name_; }

  void will_release_variables() override { last_ = true; }

  void release_variables() override {
    saved_.clear();
    DropJs();
  }

  variable_list apply(variable_list&& grads) override {
    CheckHookThread("custom function backward");
    TORCH_CHECK(!fn_.IsEmpty(), name_, ": backward ran through this graph a second time after its saved tensors were freed; ",
                "run the first backward with retainGraph");
    Napi::Env env = env_;
    Napi::HandleScope scope(env);
    std::vector<Napi::Value> made;
    Napi::Array g = Napi::Array::New(env, grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      Napi::Value v = grads[i].defined() ? TensorHandle::Wrap(env, grads[i]) : env.Undefined();
      if (grads[i].defined()) made.push_back(v);
      g.Set(static_cast<uint32_t>(i), v);
    }
    grads.clear();  // JS holds the gradients now; its scope decides when they go
    Napi::Array wanted = Napi::Array::New(env, num_outputs());
    for (size_t i = 0; i < num_outputs(); ++i) wanted.Set(static_cast<uint32_t>(i), task_should_compute_output(i));
    Napi::Array saved = Napi::Array::New(env, saved_.size());
    for (size_t i = 0; i < saved_.size(); ++i) {
      Napi::Value v = TensorHandle::Wrap(env, saved_[i]);
      made.push_back(v);
      saved.Set(static_cast<uint32_t>(i), v);
    }
    bool last = last_;
    last_ = false;
    struct ReleaseMade {
      Napi::Env env;
      std::vector<Napi::Value>& made;
      ~ReleaseMade() {
        for (auto& v : made) TensorHandle::Release(env, v);
      }
    } release_made{env, made};
    Napi::Value ret = CallJs(env, fn_, {g, wanted, saved, Napi::Boolean::New(env, last)});
    TORCH_CHECK(ret.IsArray(), name_, ": backward must return an array of gradients");
    Napi::Array r = ret.As<Napi::Array>();
    TORCH_CHECK(r.Length() == num_outputs(), name_, ": backward returned ", r.Length(), " gradient(s) for ", num_outputs(),
                " input(s)");
    variable_list out(num_outputs());
    for (uint32_t i = 0; i < r.Length(); ++i) {
      Napi::Value v = r.Get(i);
      if (TensorHandle::IsHandle(v)) out[i] = TensorHandle::Get(v);
    }
    return out;
  }

  // The JS function may only be dropped on the JS thread while the environment lives; anywhere
  // else (a collective's thread holding the last reference, process exit) it is left to the GC.
  void DropJs() {
    if (fn_.IsEmpty()) return;
    if (std::this_thread::get_id() == main_thread && env_alive.load()) {
      fn_.Reset();
    } else {
      fn_.SuppressDestruct();
    }
  }

  Napi::Env env_;
  std::string name_;
  Napi::FunctionReference fn_;
  std::vector<at::Tensor> saved_;
  bool last_ = false;
};

static Napi::Value FunctionNode(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  std::string name = info[0].As<Napi::String>().Utf8Value();
  Napi::Array ins = info[1].As<Napi::Array>();
  Napi::Array outs = info[2].As<Napi::Array>();
  Napi::Array sv = info[3].As<Napi::Array>();
  Napi::Function fn = info[4].As<Napi::Function>();
  torch::autograd::edge_list edges;
  for (uint32_t i = 0; i < ins.Length(); ++i) {
    const at::Tensor& x = TensorHandle::Get(ins.Get(i));
    TORCH_CHECK(x.requires_grad(), name, ": input ", i, " does not require grad ", DescribeTensor(x));
    edges.push_back(torch::autograd::impl::gradient_edge(x));
  }
  std::vector<at::Tensor> saved;
  for (uint32_t i = 0; i < sv.Length(); ++i) saved.push_back(TensorHandle::Get(sv.Get(i)));
  std::shared_ptr<JsFunctionNode> node(new JsFunctionNode(env, name, fn, std::move(edges), std::move(saved)),
                                       torch::autograd::deleteNode);
  Napi::Array res = Napi::Array::New(env, outs.Length());
  for (uint32_t i = 0; i < outs.Length(); ++i) {
    const at::Tensor& o = TensorHandle::Get(outs.Get(i));
    TORCH_CHECK(torch::autograd::isDifferentiableType(o.scalar_type()), name, ": output ", i, " cannot have a gradient ",
                DescribeTensor(o));
    c10::intrusive_ptr<c10::TensorImpl> impl =
        o.unsafeGetTensorImpl()->shallow_copy_and_detach(c10::VariableVersion(0), /*allow_tensor_metadata_change=*/true);
    impl->set_autograd_meta(nullptr);
    at::Tensor alias(std::move(impl));
    uint32_t nr = node->add_input_metadata(alias);
    torch::autograd::impl::set_gradient_edge(alias, {node, nr});
    res.Set(i, TensorHandle::Wrap(env, alias));
  }
  return res;
  FLOTILLA_CATCH(env, "functionNode")
}

void InitAutograd(Napi::Env env, Napi::Object exports) {
  napi_add_env_cleanup_hook(env, [](void*) { env_alive = false; }, nullptr);
  exports.Set("functionNode", Napi::Function::New(env, FunctionNode));
  exports.Set("queueBackwardCallback", Napi::Function::New(env, QueueBackwardCallback));
  exports.Set("backward", Napi::Function::New(env, Backward));
  exports.Set("autogradGrad", Napi::Function::New(env, Grad));
  exports.Set("getGrad", Napi::Function::New(env, GetGrad));
  exports.Set("setGrad", Napi::Function::New(env, SetGrad));
  exports.Set("setRequiresGrad", Napi::Function::New(env, SetRequiresGrad));
  exports.Set("setGradEnabled", Napi::Function::New(env, SetGradEnabled));
  exports.Set("isGradEnabled", Napi::Function::New(env, IsGradEnabled));
  exports.Set("gradFnName", Napi::Function::New(env, GradFnName));
  exports.Set("registerHook", Napi::Function::New(env, RegisterHook));
  exports.Set("removeHook", Napi::Function::New(env, RemoveHook));
  exports.Set("registerAccumulateGradHook", Napi::Function::New(env, RegisterAccumulateGradHook));
  exports.Set("removeAccumulateGradHook", Napi::Function::New(env, RemoveAccumulateGradHook));
}

}  // namespace flotilla

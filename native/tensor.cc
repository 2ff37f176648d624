// Tensors: the handle class, creation from and export to typed arrays, metadata, and every ATen op
// reached through the c10 dispatcher by schema name. The op table lives in TypeScript
// (src/tensor/ops.ts); this file only converts arguments by the operator's own schema.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <torch/version.h>

#include <cstring>
#include <cerrno>
#include <sys/mman.h>
#include <c10/util/strides.h>
#include <sstream>

namespace flotilla {

std::thread::id main_thread;

bool WantBacktrace() {
  static const bool want = [] {
    const char* v = std::getenv("FLOTILLA_BACKTRACE");
    return v != nullptr && std::string(v) != "0" && std::string(v) != "";
  }();
  return want;
}

std::string ShortMessage(const c10::Error& e) {
  std::string msg = WantBacktrace() ? e.what() : e.what_without_backtrace();
  // c10 appends "Exception raised from ..." lines; keep the first paragraph for users.
  if (!WantBacktrace()) {
    auto pos = msg.find("\nException raised from");
    if (pos != std::string::npos) msg = msg.substr(0, pos);
  }
  return msg;
}

static const char* DtypeName(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(s);
  }
}

std::string DescribeTensor(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << DtypeName(t.scalar_type()) << "[";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// TensorHandle: the handle table (see [Note: handle table] in common.h)

namespace {
struct Slot {
  at::Tensor tensor;
  int64_t reported = 0;  // bytes reported to V8 via AdjustExternalMemory
  uint32_t generation = 1;
  bool used = false;
};
std::vector<Slot> slots;
std::vector<uint32_t> free_slots;
int64_t live_count = 0;

void Decode(const Napi::Value& v, uint32_t* index, uint32_t* generation) {
  bool lossless = true;
  uint64_t raw = v.As<Napi::BigInt>().Uint64Value(&lossless);
  *index = static_cast<uint32_t>(raw & 0xffffffffu);
  *generation = static_cast<uint32_t>(raw >> 32);
}
}  // namespace

Napi::Array WrapTensors(Napi::Env env, const std::vector<at::Tensor>& ts) {
  Napi::Array out = Napi::Array::New(env, ts.size());
  for (size_t i = 0; i < ts.size(); ++i) out.Set(static_cast<uint32_t>(i), ts[i].defined() ? TensorHandle::Wrap(env, ts[i]) : env.Undefined());
  return out;
}

Napi::Value TensorHandle::Wrap(Napi::Env env, const at::Tensor& t) {
  uint32_t index;
  if (!free_slots.empty()) {
    index = free_slots.back();
    free_slots.pop_back();
  } else {
    index = static_cast<uint32_t>(slots.size());
    slots.emplace_back();
  }
  Slot& s = slots[index];
  s.tensor = t;
  s.used = true;
  s.reported = 0;  // reported to V8 only once the tensor may outlive its scope (ReportExternal)
  live_count++;
  uint64_t raw = (static_cast<uint64_t>(s.generation) << 32) | index;
  return Napi::BigInt::New(env, raw);
}

bool TensorHandle::IsHandle(const Napi::Value& v) {
  return v.IsBigInt();
}

at::Tensor& TensorHandle::Get(const Napi::Value& v) {
  if (!v.IsBigInt()) throw std::invalid_argument("expected a Tensor");
  uint32_t index, generation;
  Decode(v, &index, &generation);
  if (index >= slots.size() || !slots[index].used || slots[index].generation != generation) {
    throw std::invalid_argument("tensor was disposed (used after dispose() or after its tidy() scope ended)");
  }
  return slots[index].tensor;
}

bool TensorHandle::Release(Napi::Env env, const Napi::Value& v) {
  if (!v.IsBigInt()) return false;
  uint32_t index, generation;
  Decode(v, &index, &generation);
  if (index >= slots.size() || !slots[index].used || slots[index].generation != generation) return false;
  Slot& s = slots[index];
  if (s.reported != 0) Napi::MemoryManagement::AdjustExternalMemory(env, -s.reported);
  s.reported = 0;
  s.tensor.reset();
  s.used = false;
  s.generation = s.generation == 0xffffffffu ? 1 : s.generation + 1;
  free_slots.push_back(index);
  live_count--;
  return true;
}

int64_t TensorHandle::Live() {
  return live_count;
}

bool TensorHandle::ReportExternal(Napi::Env env, const Napi::Value& v) {
  uint32_t index, generation;
  Decode(v, &index, &generation);
  if (index >= slots.size() || !slots[index].used || slots[index].generation != generation) return false;
  Slot& s = slots[index];
  const at::Tensor& t = s.tensor;
  // Storage bytes of tensors that own their storage; views share a base that is counted already.
  if (s.reported != 0 || !t.defined() || t.is_view() || !t.has_storage()) return false;
  int64_t bytes = static_cast<int64_t>(t.storage().nbytes());
  if (bytes <= 0) return false;
  Napi::MemoryManagement::AdjustExternalMemory(env, bytes);
  s.reported = bytes;
  return true;
}

static Napi::Value ReleaseHandle(const Napi::CallbackInfo& info) {
  return Napi::Boolean::New(info.Env(), TensorHandle::Release(info.Env(), info[0]));
}

static Napi::Value IsLive(const Napi::CallbackInfo& info) {
  Napi::Value v = info[0];
  if (!v.IsBigInt()) return Napi::Boolean::New(info.Env(), false);
  uint32_t index, generation;
  Decode(v, &index, &generation);
  bool ok = index < slots.size() && slots[index].used && slots[index].generation == generation;
  return Napi::Boolean::New(info.Env(), ok);
}

// ---------------------------------------------------------------------------------------------
// Dispatcher ops

static std::vector<c10::OperatorHandle> ops;
static std::vector<std::string> op_names;

// lookupOp(name, overload) -> id, e.g. ("aten::add", "Tensor").
static Napi::Value LookupOp(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string name = info[0].As<Napi::String>();
  std::string overload = info[1].As<Napi::String>();
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle.has_value()) {
    throw Napi::Error::New(env, "unknown operator " + name + "." + overload + " in this libtorch build");
  }
  ops.push_back(*handle);
  op_names.push_back(overload.empty() ? name : name + "." + overload);
  return Napi::Number::New(env, static_cast<double>(ops.size() - 1));
}

static Napi::Value OpSchema(const Napi::CallbackInfo& info) {
  size_t id = info[0].As<Napi::Number>().Uint32Value();
  std::ostringstream os;
  os << ops.at(id).schema();
  return Napi::String::New(info.Env(), os.str());
}

static int64_t ToInt(const Napi::Value& v) {
  if (v.IsBigInt()) throw std::invalid_argument("expected an integer, got a Tensor");
  if (v.IsBoolean()) return v.As<Napi::Boolean>().Value() ? 1 : 0;
  if (!v.IsNumber()) throw std::invalid_argument("expected an integer");
  double d = v.As<Napi::Number>().DoubleValue();
  if (d != static_cast<double>(static_cast<int64_t>(d))) throw std::invalid_argument("expected an integer, got " + std::to_string(d));
  return static_cast<int64_t>(d);
}

static double ToDouble(const Napi::Value& v) {
  if (v.IsBoolean()) return v.As<Napi::Boolean>().Value() ? 1.0 : 0.0;
  if (!v.IsNumber()) throw std::invalid_argument("expected a number");
  return v.As<Napi::Number>().DoubleValue();
}

// Scalars follow Python: an integral JS number is an int (does not promote float tensors),
// anything else is a double.
static c10::Scalar ToScalar(const Napi::Value& v) {
  if (v.IsBoolean()) return c10::Scalar(v.As<Napi::Boolean>().Value());
  if (v.IsBigInt()) throw std::invalid_argument("expected a number, got a Tensor");
  if (!v.IsNumber()) throw std::invalid_argument("expected a number");
  double d = v.As<Napi::Number>().DoubleValue();
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return c10::Scalar(static_cast<int64_t>(d));
  return c10::Scalar(d);
}

// An op operand: a live handle whose storage still holds its bytes. A sharded parameter outside its
// unit's forward and backward has a freed storage (0 bytes) under an unchanged shape; reading it would
// read freed memory, so it is an error naming the fix instead.
static const at::Tensor& Operand(const Napi::Value& v) {
  const at::Tensor& t = TensorHandle::Get(v);
  if (t.defined() && t.has_storage() && t.numel() > 0 && t.storage().nbytes() == 0) {
    throw std::invalid_argument(
        "tensor " + DescribeTensor(t) + " has no storage: it is a sharded parameter (or gradient) whose full copy is freed "
        "outside its unit's forward and backward (under bf16-mixed ZeRO-3 inside them too: the unit is gathered as a bfloat16 "
        "copy that layers read through castParam); read it inside the wrapper's withFullParameters(), through castParam in a "
        "layer's forward, or use fullGrad()");
  }
  return t;
}

static c10::IValue ToIValue(const Napi::Value& v, const c10::TypePtr& type);

static c10::IValue ToList(const Napi::Value& v, const c10::TypePtr& elem) {
  // A bare number where int[] is expected means a one-element list (sum(dim=1)).
  std::vector<Napi::Value> items;
  if (v.IsArray()) {
    Napi::Array arr = v.As<Napi::Array>();
    for (uint32_t i = 0; i < arr.Length(); ++i) items.push_back(arr.Get(i));
  } else {
    items.push_back(v);
  }
  switch (elem->kind()) {
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType: {
      c10::List<int64_t> out;
      for (auto& it : items) out.push_back(ToInt(it));
      return out;
    }
    case c10::TypeKind::FloatType: {
      c10::List<double> out;
      for (auto& it : items) out.push_back(ToDouble(it));
      return out;
    }
    case c10::TypeKind::BoolType: {
      c10::List<bool> out;
      for (auto& it : items) out.push_back(it.As<Napi::Boolean>().Value());
      return out;
    }
    case c10::TypeKind::TensorType: {
      c10::List<at::Tensor> out;
      for (auto& it : items) out.push_back(Operand(it));
      return out;
    }
    case c10::TypeKind::OptionalType: {
      c10::List<c10::optional<at::Tensor>> out;
      for (auto& it : items) {
        if (it.IsNull() || it.IsUndefined()) out.push_back(c10::nullopt);
        else out.push_back(Operand(it));
      }
      return out;
    }
    default:
      throw std::invalid_argument("unsupported list element type " + elem->str());
  }
}

static c10::IValue ToIValue(const Napi::Value& v, const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return Operand(v);
    case c10::TypeKind::OptionalType:
      if (v.IsUndefined() || v.IsNull()) return c10::IValue();
      return ToIValue(v, type->expectRef<c10::OptionalType>().getElementType());
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
    case c10::TypeKind::ScalarTypeType:
    case c10::TypeKind::LayoutType:
    case c10::TypeKind::MemoryFormatType:
      return ToInt(v);
    case c10::TypeKind::FloatType:
      return ToDouble(v);
    case c10::TypeKind::BoolType:
      if (!v.IsBoolean()) throw std::invalid_argument("expected a boolean");
      return v.As<Napi::Boolean>().Value();
    case c10::TypeKind::NumberType:
      return ToScalar(v);
    case c10::TypeKind::StringType:
      return std::string(v.As<Napi::String>());
    case c10::TypeKind::DeviceObjType:
      return c10::Device(std::string(v.As<Napi::String>()));
    case c10::TypeKind::ListType:
      return ToList(v, type->expectRef<c10::ListType>().getElementType());
    default:
      throw std::invalid_argument("unsupported argument type " + type->str());
  }
}

static Napi::Value FromIValue(Napi::Env env, const c10::IValue& v) {
  if (v.isTensor()) return TensorHandle::Wrap(env, v.toTensor());
  if (v.isNone()) return env.Undefined();
  if (v.isDouble()) return Napi::Number::New(env, v.toDouble());
  if (v.isInt()) return Napi::Number::New(env, static_cast<double>(v.toInt()));
  if (v.isBool()) return Napi::Boolean::New(env, v.toBool());
  if (v.isScalar()) {
    auto s = v.toScalar();
    if (s.isBoolean()) return Napi::Boolean::New(env, s.toBool());
    return Napi::Number::New(env, s.toDouble());
  }
  if (v.isTensorList()) {
    auto list = v.toTensorList();
    Napi::Array arr = Napi::Array::New(env, list.size());
    for (size_t i = 0; i < list.size(); ++i) arr.Set(static_cast<uint32_t>(i), TensorHandle::Wrap(env, list.get(i)));
    return arr;
  }
  if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    Napi::Array arr = Napi::Array::New(env, elems.size());
    for (size_t i = 0; i < elems.size(); ++i) arr.Set(static_cast<uint32_t>(i), FromIValue(env, elems[i]));
    return arr;
  }
  if (v.isIntList()) {
    auto list = v.toIntVector();
    Napi::Array arr = Napi::Array::New(env, list.size());
    for (size_t i = 0; i < list.size(); ++i) arr.Set(static_cast<uint32_t>(i), Napi::Number::New(env, static_cast<double>(list[i])));
    return arr;
  }
  throw std::invalid_argument("unsupported return type " + v.tagKind());
}

static std::string DescribeArgs(const Napi::Array& args) {
  std::ostringstream os;
  for (uint32_t i = 0; i < args.Length(); ++i) {
    Napi::Value a = args.Get(i);
    if (i) os << ", ";
    if (TensorHandle::IsHandle(a)) {
      try {
        os << DescribeTensor(TensorHandle::Get(a));
      } catch (const std::exception&) {
        os << "<disposed tensor>";
      }
    } else if (a.IsArray()) {
      Napi::Array arr = a.As<Napi::Array>();
      os << "[";
      for (uint32_t j = 0; j < arr.Length(); ++j) {
        Napi::Value x = arr.Get(j);
        if (j) os << ", ";
        if (TensorHandle::IsHandle(x)) {
          try {
            os << DescribeTensor(TensorHandle::Get(x));
          } catch (const std::exception&) {
            os << "<disposed tensor>";
          }
        }
        else os << x.ToString().Utf8Value();
      }
      os << "]";
    } else if (a.IsUndefined()) {
      os << "None";
    } else {
      os << a.ToString().Utf8Value();
    }
  }
  return os.str();
}

// callOp(id, args): positional arguments in schema order; missing trailing ones take defaults.
static Napi::Value CallOp(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  size_t id = info[0].As<Napi::Number>().Uint32Value();
  Napi::Array args = info[1].As<Napi::Array>();
  const c10::OperatorHandle& op = ops.at(id);
  const c10::FunctionSchema& schema = op.schema();
  const auto& params = schema.arguments();
  try {
    if (args.Length() > params.size()) {
      throw std::invalid_argument("too many arguments: got " + std::to_string(args.Length()) + ", schema takes " +
                                  std::to_string(params.size()));
    }
    torch::jit::Stack stack;
    stack.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      Napi::Value a = i < args.Length() ? args.Get(static_cast<uint32_t>(i)) : env.Undefined();
      if (a.IsUndefined() && params[i].default_value().has_value()) {
        stack.push_back(*params[i].default_value());
      } else {
        try {
          stack.push_back(ToIValue(a, params[i].type()));
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument("argument '" + params[i].name() + "': " + e.what());
        }
      }
    }
    op.callBoxed(&stack);
    // An in-place op (its result is a written alias of self, `Tensor(a!)`) returns self: hand back
    // the caller's own handle instead of a new wrapper. Read-only aliases (contiguous() or to() of a
    // tensor that already fits) still get their own handle, so disposing one never frees the other.
    const auto& rets = schema.returns();
    bool writesSelf = rets.size() == 1 && rets[0].alias_info() != nullptr && rets[0].alias_info()->isWrite();
    if (writesSelf && stack.size() == 1 && stack[0].isTensor() && args.Length() > 0 && TensorHandle::IsHandle(args.Get(0u)) &&
        TensorHandle::Get(args.Get(0u)).is_same(stack[0].toTensor())) {
      return args.Get(0u);
    }
    if (stack.size() == 1) return FromIValue(env, stack[0]);
    Napi::Array out = Napi::Array::New(env, stack.size());
    for (size_t i = 0; i < stack.size(); ++i) out.Set(static_cast<uint32_t>(i), FromIValue(env, stack[i]));
    return out;
  } catch (const Napi::Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Napi::Error::New(env, op_names[id] + "(" + DescribeArgs(args) + "): " + ShortMessage(e));
  } catch (const std::exception& e) {
    throw Napi::Error::New(env, op_names[id] + "(" + DescribeArgs(args) + "): " + e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// Creation from and export to JS memory

// fromBuffer(typedArray, shape, dtype): copies the bytes into a new tensor.
static Napi::Value FromBuffer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  Napi::TypedArray ta = info[0].As<Napi::TypedArray>();
  Napi::Array shapeArr = info[1].As<Napi::Array>();
  auto dtype = static_cast<at::ScalarType>(info[2].As<Napi::Number>().Int32Value());
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (uint32_t i = 0; i < shapeArr.Length(); ++i) {
    shape.push_back(ToInt(shapeArr.Get(i)));
    numel *= shape.back();
  }
  size_t bytes = ta.ByteLength();
  size_t expect = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes != expect) {
    throw std::invalid_argument("buffer has " + std::to_string(bytes) + " bytes, shape needs " + std::to_string(expect));
  }
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  auto* src = static_cast<uint8_t*>(ta.ArrayBuffer().Data()) + ta.ByteOffset();
  if (bytes) std::memcpy(t.data_ptr(), src, bytes);
  return TensorHandle::Wrap(env, t);
  FLOTILLA_CATCH(env, "fromBuffer")
}

// [Note: mapped storage] emptyMapped(shape, dtype): an uninitialised tensor whose storage is pages
// mapped for it alone (mmap) and unmapped when it is freed or resized (resizeStorage to 0 and back
// goes through the same allocator). Such memory goes back to the OS the moment it is freed and
// never fragments the malloc heap. Which tensors get it is decided in TypeScript (src/tensor/allocator.ts).
namespace {
struct MappedRegion {
  void* addr;
  size_t len;
};

void UnmapRegion(void* ctx) {
  auto* r = static_cast<MappedRegion*>(ctx);
  if (r == nullptr) return;
  munmap(r->addr, r->len);
  delete r;
}

struct MappedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &UnmapRegion, cpu};
    void* addr = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(addr != MAP_FAILED, "emptyMapped: mmap of ", nbytes, " bytes failed: ", std::strerror(errno));
    // Transparent huge pages where the kernel offers them on request: a region is mapped and unmapped
    // around every use (a gradient bucket, a collective's staging), and with 4 KiB pages each use paid
    // a fault and a page-table entry per page (half a second a step for a 25M-parameter ZeRO-2 model
    // in a virtual machine). Advice only: without THP the region still works with small pages.
    if (nbytes >= (2u << 20)) madvise(addr, nbytes, MADV_HUGEPAGE);
    return {addr, new MappedRegion{addr, nbytes}, &UnmapRegion, cpu};
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif
};

MappedAllocator g_mapped_allocator;
}  // namespace

static Napi::Value EmptyMapped(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  Napi::Array shapeArr = info[0].As<Napi::Array>();
  auto dtype = static_cast<at::ScalarType>(info[1].As<Napi::Number>().Int32Value());
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (uint32_t i = 0; i < shapeArr.Length(); ++i) {
    shape.push_back(ToInt(shapeArr.Get(i)));
    numel *= shape.back();
  }
  size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, &g_mapped_allocator, /*resizable=*/true);
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype));
  t.set_(storage, 0, shape, c10::contiguous_strides(shape));
  return TensorHandle::Wrap(env, t);
  FLOTILLA_CATCH(env, "emptyMapped")
}

// toBuffer(t): a contiguous copy of the data as an ArrayBuffer.
static Napi::Value ToBuffer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor t = Operand(info[0]).detach().contiguous();
  size_t bytes = t.numel() * t.element_size();
  Napi::ArrayBuffer buf = Napi::ArrayBuffer::New(env, bytes);
  if (bytes) std::memcpy(buf.Data(), t.data_ptr(), bytes);
  return buf;
  FLOTILLA_CATCH(env, "toBuffer")
}

// copyToBuffer(t, uint8Array): copies the tensor's bytes (C order) into the start of an existing
// Uint8Array (a reused staging buffer, e.g. over a SharedArrayBuffer), which must be large enough.
static Napi::Value CopyToBuffer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Tensor t = Operand(info[0]).detach().contiguous();
  // A Uint8Array's own data pointer: it may view a SharedArrayBuffer, which is no Napi::ArrayBuffer.
  Napi::Uint8Array ta = info[1].As<Napi::Uint8Array>();
  size_t bytes = t.numel() * t.element_size();
  if (bytes > ta.ByteLength()) {
    throw std::invalid_argument("tensor has " + std::to_string(bytes) + " bytes, the buffer holds " + std::to_string(ta.ByteLength()));
  }
  if (bytes) std::memcpy(ta.Data(), t.data_ptr(), bytes);
  return Napi::Number::New(env, static_cast<double>(bytes));
  FLOTILLA_CATCH(env, "copyToBuffer")
}

// meta(t) -> [shape, dtype, requiresGrad, isLeaf, strides, storageOffset]
static Napi::Value Meta(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  Napi::Array shape = Napi::Array::New(env, t.dim());
  Napi::Array strides = Napi::Array::New(env, t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    shape.Set(static_cast<uint32_t>(i), Napi::Number::New(env, static_cast<double>(t.size(i))));
    strides.Set(static_cast<uint32_t>(i), Napi::Number::New(env, static_cast<double>(t.stride(i))));
  }
  Napi::Array out = Napi::Array::New(env, 6);
  out.Set(0u, shape);
  out.Set(1u, Napi::Number::New(env, static_cast<int>(t.scalar_type())));
  out.Set(2u, Napi::Boolean::New(env, t.requires_grad()));
  out.Set(3u, Napi::Boolean::New(env, t.is_leaf()));
  out.Set(4u, strides);
  out.Set(5u, Napi::Number::New(env, static_cast<double>(t.storage_offset())));
  return out;
  FLOTILLA_CATCH(env, "meta")
}

static Napi::Value Shape(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  Napi::Array shape = Napi::Array::New(env, t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) shape.Set(static_cast<uint32_t>(i), Napi::Number::New(env, static_cast<double>(t.size(i))));
  return shape;
  FLOTILLA_CATCH(env, "shape")
}

static Napi::Value Dtype(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  return Napi::Number::New(env, static_cast<int>(TensorHandle::Get(info[0]).scalar_type()));
  FLOTILLA_CATCH(env, "dtype")
}

// Address of the first element: tests use it to prove that views and grads share storage.
static Napi::Value DataPtr(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  return Napi::BigInt::New(env, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())));
  FLOTILLA_CATCH(env, "dataPtr")
}

static Napi::Value SetSeed(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::manual_seed(static_cast<uint64_t>(ToInt(info[0])));
  return env.Undefined();
  FLOTILLA_CATCH(env, "manualSeed")
}

// rngState() / setRngState(state): the default CPU generator's whole state as a uint8 tensor, and
// back (PyTorch's get_rng_state / set_rng_state).
static Napi::Value RngState(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return TensorHandle::Wrap(env, gen.get_state());
  FLOTILLA_CATCH(env, "rngState")
}

static Napi::Value SetRngState(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(TensorHandle::Get(info[0]));
  return env.Undefined();
  FLOTILLA_CATCH(env, "setRngState")
}

static Napi::Value SetNumThreads(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  at::set_num_threads(static_cast<int>(ToInt(info[0])));
  return env.Undefined();
  FLOTILLA_CATCH(env, "setNumThreads")
}

static Napi::Value GetNumThreads(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), at::get_num_threads());
}

// reportExternal(t): tells V8 about the tensor's storage bytes (the caller decides when: a tensor
// freed by its scope never needs to be, one that may live on does, so GC pressure stays real).
static Napi::Value ReportExternal(const Napi::CallbackInfo& info) {
  return Napi::Boolean::New(info.Env(), TensorHandle::ReportExternal(info.Env(), info[0]));
}

static Napi::Value LiveTensors(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), static_cast<double>(TensorHandle::Live()));
}

static Napi::Value Version(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Object o = Napi::Object::New(env);
  o.Set("torch", std::string(TORCH_VERSION));
  o.Set("parallel", at::get_parallel_info());
  return o;
}

// ---------------------------------------------------------------------------------------------
// Storage: sharded data parallelism frees a gathered parameter's memory between uses while the
// tensor (and views that autograd saved) keep their shape; resizing the shared StorageImpl frees
// and re-allocates the bytes under every view at once. Writing the gathered values through
// variableData() (PyTorch's .data: same storage, its own version counter) does not bump the
// version that autograd checks on saved views.

static Napi::Value ResizeStorage(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  int64_t nbytes = ToInt(info[1]);
  TORCH_CHECK(nbytes >= 0, "resizeStorage: nbytes must be >= 0, got ", nbytes);
  TORCH_CHECK(t.device().is_cpu(), "resizeStorage: only CPU storage is supported, got ", DescribeTensor(t));
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), static_cast<size_t>(nbytes));
  return env.Undefined();
  FLOTILLA_CATCH(env, "resizeStorage")
}

static Napi::Value StorageNbytes(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  const at::Tensor& t = TensorHandle::Get(info[0]);
  return Napi::Number::New(env, static_cast<double>(t.storage().nbytes()));
  FLOTILLA_CATCH(env, "storageNbytes")
}

static Napi::Value VariableData(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  FLOTILLA_TRY
  return TensorHandle::Wrap(env, TensorHandle::Get(info[0]).variable_data());
  FLOTILLA_CATCH(env, "variableData")
}

void InitTensor(Napi::Env env, Napi::Object exports) {
  exports.Set("resizeStorage", Napi::Function::New(env, ResizeStorage));
  exports.Set("emptyMapped", Napi::Function::New(env, EmptyMapped));
  exports.Set("storageNbytes", Napi::Function::New(env, StorageNbytes));
  exports.Set("variableData", Napi::Function::New(env, VariableData));
  exports.Set("release", Napi::Function::New(env, ReleaseHandle));
  exports.Set("isLive", Napi::Function::New(env, IsLive));
  exports.Set("lookupOp", Napi::Function::New(env, LookupOp));
  exports.Set("opSchema", Napi::Function::New(env, OpSchema));
  exports.Set("callOp", Napi::Function::New(env, CallOp));
  exports.Set("fromBuffer", Napi::Function::New(env, FromBuffer));
  exports.Set("toBuffer", Napi::Function::New(env, ToBuffer));
  exports.Set("copyToBuffer", Napi::Function::New(env, CopyToBuffer));
  exports.Set("meta", Napi::Function::New(env, Meta));
  exports.Set("shape", Napi::Function::New(env, Shape));
  exports.Set("dtype", Napi::Function::New(env, Dtype));
  exports.Set("dataPtr", Napi::Function::New(env, DataPtr));
  exports.Set("manualSeed", Napi::Function::New(env, SetSeed));
  exports.Set("rngState", Napi::Function::New(env, RngState));
  exports.Set("setRngState", Napi::Function::New(env, SetRngState));
  exports.Set("setNumThreads", Napi::Function::New(env, SetNumThreads));
  exports.Set("getNumThreads", Napi::Function::New(env, GetNumThreads));
  exports.Set("liveTensors", Napi::Function::New(env, LiveTensors));
  exports.Set("reportExternal", Napi::Function::New(env, ReportExternal));
  exports.Set("version", Napi::Function::New(env, Version));
}

}  // namespace flotilla

// sntf Grappler plugin shim.
//
// This one shared object is two things at once:
//   * a TensorFlow graph plugin: it exports TF_InitGraph, so
//     load_pluggable_device_library() (or TensorFlow's auto-load of
//     site-packages/tensorflow-plugins/) registers a CPU graph optimizer;
//   * a pybind11 module (sntf._plugin) with a few introspection helpers.
//
// The optimizer itself is Python: for every graph, the callback takes the GIL
// and calls sntf.runtime.plugin._optimize(graph_bytes, fetch, preserve, properties).
// The callable is looked up in sys.modules by name rather than stored in a
// global, so that any copy of this library (auto-loaded from another path, or
// loaded before sntf was imported) reaches the same Python pass, and so that
// the callback never imports anything while TensorFlow is running.
//
// Whatever happens, the callback returns OK with either the rewritten graph or
// the input graph unchanged: nothing reaches TensorFlow as an error or abort.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensorflow/c/c_api.h"
#include "tensorflow/c/experimental/grappler/grappler.h"

namespace py = pybind11;

namespace sntf {
namespace {

// Environment variable that marks "an sntf graph optimizer is registered in
// this process". Process-wide on purpose: two copies of this library have two
// sets of globals, but one environment. Registering twice aborts TensorFlow.
constexpr char kRegisteredEnv[] = "SNTF_PLUGIN_REGISTERED";
constexpr char kDuplicatesEnv[] = "SNTF_PLUGIN_DUPLICATES";
constexpr char kPassModule[] = "sntf.runtime.plugin";
constexpr char kPassFunction[] = "_optimize";

std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_passthrough{0};
std::atomic<int64_t> g_native_errors{0};
std::mutex g_error_mu;
std::string g_last_native_error;  // guarded by g_error_mu

void RecordNativeError(const std::string& what) {
  g_native_errors.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_error_mu);
  if (g_last_native_error.empty()) {
    // Logged once per process; the full history lives in the Python reports.
    fprintf(stderr, "sntf: graph pass failed, graph left unchanged: %s\n",
            what.c_str());
  }
  g_last_native_error = what;
}

void FreeBufferData(void* data, size_t /*length*/) { std::free(data); }

// Copies bytes into a TF_Buffer that TensorFlow will free with TF_DeleteBuffer.
bool FillBuffer(const char* data, size_t length, TF_Buffer* out) {
  void* copy = std::malloc(length == 0 ? 1 : length);
  if (copy == nullptr) return false;
  if (length > 0) std::memcpy(copy, data, length);
  if (out->data_deallocator != nullptr && out->data != nullptr) {
    out->data_deallocator(const_cast<void*>(out->data), out->length);
  }
  out->data = copy;
  out->length = length;
  out->data_deallocator = FreeBufferData;
  return true;
}

using NameListSizeFn = void (*)(const TF_GrapplerItem*, int*, size_t*,
                                TF_Status*);
using NameListFn = void (*)(const TF_GrapplerItem*, char**, size_t*, int,
                            void*, size_t, TF_Status*);

// Reads one of the item's node-name lists (fetch or nodes-to-preserve).
bool ReadNameList(const TF_GrapplerItem* item, NameListSizeFn size_fn,
                  NameListFn list_fn, std::vector<std::string>* names,
                  std::string* error) {
  std::unique_ptr<TF_Status, decltype(&TF_DeleteStatus)> status(
      TF_NewStatus(), TF_DeleteStatus);
  int num = 0;
  size_t storage_size = 0;
  size_fn(item, &num, &storage_size, status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    *error = TF_Message(status.get());
    return false;
  }
  std::vector<char*> values(num);
  std::vector<size_t> lengths(num);
  std::vector<char> storage(storage_size + 1);
  list_fn(item, values.data(), lengths.data(), num, storage.data(),
          storage.size(), status.get());
  if (TF_GetCode(status.get()) != TF_OK) {
    *error = TF_Message(status.get());
    return false;
  }
  names->clear();
  for (int i = 0; i < num; ++i) names->emplace_back(values[i], lengths[i]);
  return true;
}

// Static output properties of a graph, inferred lazily (only when the Python
// pass asks, since inference costs time on graphs the pass skips) and valid
// only while the callback runs.
class LazyProperties {
 public:
  explicit LazyProperties(const TF_GrapplerItem* item) : item_(item) {}
  ~LazyProperties() { Invalidate(); }

  void Invalidate() {
    valid_ = false;
    if (props_ != nullptr) TF_DeleteGraphProperties(props_);
    props_ = nullptr;
  }

  // Returns {node name: [serialized OpInfo.TensorProperties per output]}.
  py::dict Outputs(const std::vector<std::string>& names) {
    if (!valid_) {
      throw std::runtime_error(
          "sntf: graph properties are only valid during the Grappler callback");
    }
    EnsureInferred();
    py::dict result;
    std::unique_ptr<TF_Status, decltype(&TF_DeleteStatus)> status(
        TF_NewStatus(), TF_DeleteStatus);
    for (const std::string& name : names) {
      result[py::str(name)] = OutputsOf(name, status.get());
    }
    return result;
  }

 private:
  void EnsureInferred() {
    if (props_ != nullptr) return;
    props_ = TF_NewGraphProperties(item_);
    std::unique_ptr<TF_Status, decltype(&TF_DeleteStatus)> status(
        TF_NewStatus(), TF_DeleteStatus);
    TF_InferStatically(props_, /*assume_valid_feeds=*/true,
                       /*aggressive_shape_inference=*/false,
                       /*include_input_tensor_values=*/false,
                       /*include_output_tensor_values=*/false, status.get());
    if (TF_GetCode(status.get()) != TF_OK) {
      std::string message = TF_Message(status.get());
      Invalidate();
      valid_ = true;  // the callback is still running; a retry may be asked
      throw std::runtime_error("sntf: shape inference failed: " + message);
    }
  }

  py::list OutputsOf(const std::string& name, TF_Status* status) {
    py::list out;
    int num = 0;
    TF_GetOutputPropertiesListSize(props_, name.c_str(), &num, status);
    if (TF_GetCode(status) != TF_OK || num <= 0) return out;
    std::vector<TF_Buffer*> buffers(num);
    for (int i = 0; i < num; ++i) buffers[i] = TF_NewBuffer();
    TF_GetOutputPropertiesList(props_, name.c_str(), buffers.data(), num,
                               status);
    bool ok = TF_GetCode(status) == TF_OK;
    for (int i = 0; i < num; ++i) {
      if (ok) {
        out.append(py::bytes(static_cast<const char*>(buffers[i]->data),
                             buffers[i]->length));
      }
      TF_DeleteBuffer(buffers[i]);
    }
    return out;
  }

  const TF_GrapplerItem* item_;
  TF_GraphProperties* props_ = nullptr;
  bool valid_ = true;
};

// Looks up the Python pass; returns None when sntf is not imported.
py::object FindPass() {
  py::dict modules = py::module_::import("sys").attr("modules");
  if (!modules.contains(kPassModule)) return py::none();
  py::object module = modules[kPassModule];
  if (!py::hasattr(module, kPassFunction)) return py::none();
  return module.attr(kPassFunction);
}

// Raises KeyboardInterrupt again in the main thread: trips SIGINT as a real
// Ctrl-C would, so Python's handler raises it at the main thread's next
// bytecode, once TensorFlow returns there (or runs a handler the user set).
void PassOnInterrupt() { PyErr_SetInterrupt(); }

// Raises a SystemExit again in the main thread, with its exit code, as that
// thread's asynchronous exception. The class comes from the Python side
// (_exit_class): the interpreter raises an asynchronous exception by
// instantiating it without arguments. Falls back to an interrupt.
void PassOnExit(const py::object& error) {
  try {
    py::object made = py::module_::import(kPassModule).attr("_exit_class")(error);
    py::tuple pair = made.cast<py::tuple>();
    const unsigned long thread = pair[0].cast<unsigned long>();
    PyThreadState_SetAsyncExc(thread, pair[1].ptr());
    return;
  } catch (py::error_already_set& e) {
    RecordNativeError(std::string("passing SystemExit on: ") + e.what());
    e.restore();
    PyErr_Clear();
  } catch (const std::exception& e) {
    RecordNativeError(std::string("passing SystemExit on: ") + e.what());
  }
  PyErr_SetInterrupt();
}

// Runs the Python pass. Returns true and fills `out` with the new graph when
// the pass produced one; false means "use the input graph".
//
// A KeyboardInterrupt or SystemExit from the pass (Ctrl-C, or a signal
// handler's sys.exit, while a graph was planned) is not a failure of the pass
// and must not be lost: no exception may cross this callback, so the graph
// goes back unchanged and the interrupt is raised again in the main thread
// (PassOnInterrupt), where fit() runs.
bool RunPythonPass(const TF_Buffer* graph_buf, const TF_GrapplerItem* item,
                   std::string* out) {
  py::gil_scoped_acquire gil;
  enum { kNone, kKeyboard, kExit } interrupt = kNone;
  // Declared before every other Python object of this call, so destroyed
  // after them: nothing that might run Python code is left to run once the
  // interrupt is armed.
  py::object exit_error;
  const bool changed = [&]() -> bool {
  try {
    py::object pass = FindPass();
    if (pass.is_none()) return false;

    std::vector<std::string> fetch, preserve;
    std::string error;
    if (!ReadNameList(item, TF_GetFetchNodesListSize, TF_GetFetchNodesList,
                      &fetch, &error) ||
        !ReadNameList(item, TF_GetNodesToPreserveListSize,
                      TF_GetNodesToPreserveList, &preserve, &error)) {
      RecordNativeError("reading the grappler item: " + error);
      return false;
    }
    auto props = std::make_shared<LazyProperties>(item);
    // Whatever happens below, the properties die with this callback: the
    // Python side may keep the callable, never the item behind it.
    struct InvalidateOnExit {
      std::shared_ptr<LazyProperties> props;
      ~InvalidateOnExit() { props->Invalidate(); }
    } guard{props};
    py::cpp_function outputs(
        [props](const std::vector<std::string>& names) {
          return props->Outputs(names);
        });
    py::bytes graph(static_cast<const char*>(graph_buf->data),
                    graph_buf->length);
    py::object result = pass(graph, fetch, preserve, outputs);
    if (result.is_none()) return false;
    *out = result.cast<std::string>();
    return true;
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_KeyboardInterrupt)) {
      interrupt = kKeyboard;
    } else if (e.matches(PyExc_SystemExit)) {
      interrupt = kExit;
      exit_error = e.value();
    } else {
      // The Python pass records its own failures; reaching here means the
      // entry point itself failed.
      RecordNativeError(e.what());
    }
    e.restore();
    PyErr_Clear();
  } catch (const std::exception& e) {
    RecordNativeError(e.what());
  } catch (...) {
    RecordNativeError("unknown C++ exception");
  }
  return false;
  }();
  if (interrupt == kKeyboard) {
    PassOnInterrupt();
  } else if (interrupt == kExit) {
    PassOnExit(exit_error);
  }
  return changed;
}

void Optimize(void* /*optimizer*/, const TF_Buffer* graph_buf,
              const TF_GrapplerItem* item, TF_Buffer* optimized_graph_buf,
              TF_Status* status) {
  TF_SetStatus(status, TF_OK, "");
  g_calls.fetch_add(1);
  std::string rewritten;
  bool changed = false;
  try {
    if (Py_IsInitialized()) changed = RunPythonPass(graph_buf, item, &rewritten);
  } catch (...) {
    RecordNativeError("exception while taking the GIL");
    changed = false;
  }
  bool filled = changed ? FillBuffer(rewritten.data(), rewritten.size(),
                                     optimized_graph_buf)
                        : false;
  if (!filled) {
    g_passthrough.fetch_add(1);
    filled = FillBuffer(static_cast<const char*>(graph_buf->data),
                        graph_buf->length, optimized_graph_buf);
  }
  if (!filled) {
    // Out of host memory for a copy of the graph: an error status makes the
    // meta-optimizer keep the graph it had, which is what we want.
    TF_SetStatus(status, TF_RESOURCE_EXHAUSTED,
                 "sntf: could not allocate the output graph buffer");
  }
}

// Optimizer of an inactive duplicate registration: hands the graph back.
void PassThrough(void* /*optimizer*/, const TF_Buffer* graph_buf,
                 const TF_GrapplerItem* /*item*/, TF_Buffer* optimized_graph_buf,
                 TF_Status* status) {
  TF_SetStatus(status, TF_OK, "");
  if (!FillBuffer(static_cast<const char*>(graph_buf->data), graph_buf->length,
                  optimized_graph_buf)) {
    TF_SetStatus(status, TF_RESOURCE_EXHAUSTED,
                 "sntf: could not allocate the output graph buffer");
  }
}

// Path of the object this code lives in, for diagnostics.
std::string ThisLibraryPath();

}  // namespace
}  // namespace sntf

#include <dlfcn.h>
#include <pthread.h>
#include <sys/auxv.h>
#include <unistd.h>

namespace sntf {
namespace {
std::string ThisLibraryPath() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&Optimize), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  return info.dli_fname;
}

// What identifies this process image: the pid, and the 16 random bytes the
// kernel hands every exec (AT_RANDOM in the auxiliary vector). exec keeps
// the pid and the environment but drops TensorFlow's optimizer registry, so
// a marker left by the image before exec must not count; every library
// loaded in one image sees the same bytes, and a fork()ed child inherits
// them along with the registry.
std::string ImagePrefix() {
  std::string prefix = std::to_string(static_cast<long>(getpid())) + ":";
  const auto* random =
      reinterpret_cast<const unsigned char*>(getauxval(AT_RANDOM));
  if (random != nullptr) {
    static const char kHex[] = "0123456789abcdef";
    for (int i = 0; i < 16; ++i) {
      prefix += kHex[random[i] >> 4];
      prefix += kHex[random[i] & 0xf];
    }
  }
  return prefix + ":";
}

// The marker holds "<pid>:<exec token>:<library path>".
std::string RegisteredOwner() {
  const char* value = std::getenv(kRegisteredEnv);
  if (value == nullptr) return "";
  std::string marker(value);
  const std::string prefix = ImagePrefix();
  if (marker.compare(0, prefix.size(), prefix) != 0) return "";
  return marker.substr(prefix.size());
}

// A device type no device has, unique per duplicate across library copies
// (which share the environment but not their globals).
std::string NextInactiveDeviceType() {
  const char* value = std::getenv(kDuplicatesEnv);
  long count = value == nullptr ? 0 : std::strtol(value, nullptr, 10);
  ++count;
  setenv(kDuplicatesEnv, std::to_string(count).c_str(), 1);
  return "SNTF_INACTIVE_DUPLICATE_" + std::to_string(count);
}

void WriteMarker() {
  const std::string marker = ImagePrefix() + ThisLibraryPath();
  setenv(kRegisteredEnv, marker.c_str(), 1);
}

void MarkRegistered() {
  WriteMarker();
  // A fork()ed child inherits TensorFlow's optimizer registry with the
  // parent's memory, so it is registered too: re-stamp the marker with the
  // child's pid. (After exec the registry is gone, and the exec token no
  // longer matches, even when the pid does.)
  pthread_atfork(nullptr, nullptr, WriteMarker);
}
}  // namespace
}  // namespace sntf

extern "C" {

// Called by TensorFlow when it loads this library as a graph plugin.
__attribute__((visibility("default"))) void TF_InitGraph(
    TP_OptimizerRegistrationParams* params, TF_Status* status) {
  params->struct_size = TP_OPTIMIZER_REGISTRATION_PARAMS_STRUCT_SIZE;
  params->optimizer_configs->struct_size = TP_OPTIMIZER_CONFIGS_STRUCT_SIZE;
  params->optimizer->struct_size = TP_OPTIMIZER_STRUCT_SIZE;
  params->optimizer->create_func = nullptr;
  params->optimizer->destroy_func = nullptr;
  TF_SetStatus(status, TF_OK, "");
  std::string owner = sntf::RegisteredOwner();
  if (!owner.empty()) {
    // TensorFlow aborts both on a second optimizer for "CPU" and on an error
    // status from this function. A copy loaded from another path therefore
    // registers for a device type that never exists, where it never runs.
    // TensorFlow keeps this pointer for the life of the process: leak it.
    params->device_type = strdup(sntf::NextInactiveDeviceType().c_str());
    params->optimizer->optimize_func = sntf::PassThrough;
    fprintf(stderr,
            "sntf: graph plugin already registered in this process by %s; "
            "%s stays inactive\n",
            owner.c_str(), sntf::ThisLibraryPath().c_str());
    return;
  }
  params->device_type = "CPU";
  params->optimizer->optimize_func = sntf::Optimize;
  sntf::MarkRegistered();
}

}  // extern "C"

PYBIND11_MODULE(_plugin, m) {
  m.doc() = "sntf Grappler plugin shim (also exports TF_InitGraph).";
  m.def("library_path", &sntf::ThisLibraryPath,
        "Path of this shared object.");
  m.def("registered_path", &sntf::RegisteredOwner,
      "Path of the sntf plugin registered in this process, or ''.");
  m.def("counters", []() {
    py::dict d;
    d["calls"] = sntf::g_calls.load();
    d["passthrough"] = sntf::g_passthrough.load();
    d["native_errors"] = sntf::g_native_errors.load();
    std::lock_guard<std::mutex> lock(sntf::g_error_mu);
    d["last_native_error"] = sntf::g_last_native_error;
    return d;
  }, "Callback counters of this copy of the library.");
}

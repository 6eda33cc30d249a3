// lowfp._C.round_bound(requests, x, counts, out): lowfp.quantize.BoundRounder's one native call,
// in C: where x is a plain, contiguous CPU tensor (backends.ready_on_cpu) of a dtype that
// `requests` (dict: torch.dtype -> PreparedQuantize) holds, round it by that request into `out`
// (None: a new tensor like x, as _memory.new_output makes it), adding its counts at the address
// `counts` (0: none); the result, or None where the call does not take x (nothing was done).
//
// lowfp._C.round_bound_setup(plain_types, backends, get_num_threads, strided, empty_like,
// new_output, min_bytes, preserve_format) hands it, once, the Python objects it calls (kept for the process's life).
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include "def_intercept.hpp"
#include "def_quantize.hpp"

namespace lowfp::bound_round {

namespace py = pybind11;
using intercept::attr;
using intercept::steal;
using intercept::truth;

struct Objects {
  PyObject* tensor = nullptr;      // torch.Tensor
  PyObject* parameter = nullptr;   // torch.nn.Parameter
  PyObject* ready_on_cpu = nullptr;
  PyObject* empty_like = nullptr;
  PyObject* new_output = nullptr;  // new_output(like, dtype, memory_format), from min_bytes on
  PyObject* preserve_format = nullptr;
  int64_t min_bytes = 0;
  PyObject* backends = nullptr;       // lowfp.backends (its _torch_threads)
  PyObject* get_num_threads = nullptr;
  PyObject* strided = nullptr;        // torch.strided
  PyObject *dtype, *is_contiguous, *data_ptr, *numel, *element_size, *is_cpu, *is_nested, *layout,
      *torch_threads;
};

inline Objects& objects() {
  static Objects o;
  return o;
}

inline int64_t as_int(const py::object& v) {
  const long long r = PyLong_AsLongLong(v.ptr());
  if (r == -1 && PyErr_Occurred()) throw py::error_already_set();
  return r;
}

// backends.ready_on_cpu(x): answered here where x is a strided, not nested CPU tensor and torch's
// thread count is the one lowfp follows (backends._torch_threads), else by the Python function.
inline bool ready_on_cpu(PyObject* x) {
  const Objects& o = objects();
  if (attr(x, o.is_cpu).ptr() == Py_True && attr(x, o.is_nested).ptr() == Py_False &&
      attr(x, o.layout).ptr() == o.strided) {
    py::object threads = steal(PyObject_CallNoArgs(o.get_num_threads));
    py::object followed = attr(o.backends, o.torch_threads);
    if (truth(PyObject_RichCompareBool(threads.ptr(), followed.ptr(), Py_EQ))) return true;
  }
  return truth(PyObject_IsTrue(steal(PyObject_CallOneArg(o.ready_on_cpu, x)).ptr()));
}

template <class Run>
py::object round_bound(PyObject* requests, PyObject* x, PyObject* counts, PyObject* out, Run& run) {
  const Objects& o = objects();
  if (o.tensor == nullptr) throw std::runtime_error("lowfp._C.round_bound_setup was not called");
  PyTypeObject* type = Py_TYPE(x);
  if (type != reinterpret_cast<PyTypeObject*>(o.tensor) &&
      type != reinterpret_cast<PyTypeObject*>(o.parameter))
    return py::none();
  py::object dtype = attr(x, o.dtype);
  PyObject* request = PyDict_GetItemWithError(requests, dtype.ptr());
  if (request == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::none();
  }
  py::object keep_request = py::reinterpret_borrow<py::object>(request);
  QuantizeCall call;
  try {
    call = py::cast<const PreparedQuantize&>(py::handle(request)).call;
  } catch (const py::cast_error&) {
    return py::none();  // (another module's request)
  }
  if (!ready_on_cpu(x) || !truth(PyObject_IsTrue(steal(PyObject_CallMethodNoArgs(x, o.is_contiguous)).ptr())))
    return py::none();
  const int64_t n = as_int(steal(PyObject_CallMethodNoArgs(x, o.numel)));
  py::object y;
  if (out != Py_None) {
    y = py::reinterpret_borrow<py::object>(out);
  } else if (n * as_int(steal(PyObject_CallMethodNoArgs(x, o.element_size))) < o.min_bytes) {
    y = steal(PyObject_CallOneArg(o.empty_like, x));
  } else {
    y = steal(PyObject_CallFunctionObjArgs(o.new_output, x, dtype.ptr(), o.preserve_format, nullptr));
  }
  call.x = reinterpret_cast<const void*>(as_int(steal(PyObject_CallMethodNoArgs(x, o.data_ptr))));
  call.y = reinterpret_cast<void*>(as_int(steal(PyObject_CallMethodNoArgs(y.ptr(), o.data_ptr))));
  call.n = n;
  call.seed = 0;
  call.offset = 0;
  const int64_t count_at = as_int(py::reinterpret_borrow<py::object>(counts));
  call.count = count_at != 0;
  {
    py::gil_scoped_release release;
    run(call, reinterpret_cast<int64_t*>(count_at));
  }
  return y;
}

template <class Run>
void def_bound_round(py::module_& mod, Run run) {
  mod.def("round_bound_setup", [](py::tuple plain_types, py::object backends, py::object get_num_threads,
                                  py::object strided, py::object empty_like, py::object new_output,
                                  int64_t min_bytes, py::object preserve_format) {
    if (plain_types.size() != 2) throw std::invalid_argument("plain_types: (Tensor, Parameter)");
    Objects& o = objects();
    o.tensor = py::object(plain_types[0]).release().ptr();
    o.parameter = py::object(plain_types[1]).release().ptr();
    o.backends = backends.inc_ref().ptr();
    o.ready_on_cpu = py::object(backends.attr("ready_on_cpu")).release().ptr();
    o.get_num_threads = get_num_threads.inc_ref().ptr();
    o.strided = strided.inc_ref().ptr();
    o.is_cpu = intercept::intern("is_cpu");
    o.is_nested = intercept::intern("is_nested");
    o.layout = intercept::intern("layout");
    o.torch_threads = intercept::intern("_torch_threads");
    o.empty_like = empty_like.inc_ref().ptr();
    o.new_output = new_output.inc_ref().ptr();
    o.preserve_format = preserve_format.inc_ref().ptr();
    o.min_bytes = min_bytes;
    o.dtype = intercept::intern("dtype");
    o.is_contiguous = intercept::intern("is_contiguous");
    o.data_ptr = intercept::intern("data_ptr");
    o.numel = intercept::intern("numel");
    o.element_size = intercept::intern("element_size");
  });
  static Run kept = run;
  static PyMethodDef methods[] = {
      {"round_bound",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             if (argc != 4) {
               PyErr_SetString(PyExc_TypeError, "round_bound(requests, x, counts, out)");
               return nullptr;
             }
             if (!PyDict_Check(argv[0])) {
               PyErr_SetString(PyExc_TypeError, "round_bound: requests must be a dict");
               return nullptr;
             }
             try {
               return round_bound(argv[0], argv[1], argv[2], argv[3], kept).release().ptr();
             } catch (py::error_already_set& e) {
               e.restore();
             } catch (const std::exception& e) {
               PyErr_SetString(PyExc_RuntimeError, e.what());
             }
             return nullptr;
           })),
       METH_FASTCALL, "round_bound(requests, x, counts, out): BoundRounder's native call"},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(mod.ptr(), methods) < 0) throw py::error_already_set();
}

}  // namespace lowfp::bound_round

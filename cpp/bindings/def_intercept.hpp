// lowfp._C.intercept_call(session, func, args, kwargs): the eager path of
// lowfp._intercept.ForwardSession.call, the torch-function call that the emulation and the trace
// see for every operator of a forward (docs/design.md §6). The Python method is the definition
// (and what torch.compile traces); this is the same algorithm step for step, without the
// interpreter's work per argument: classify the function (the cached table), map the arguments
// (a tracked tensor's tag read, a named parameter's name found, anything else but a plain tensor
// handed to session._see), call it,
// note a write into an argument, and name, decide and tag a single floating result. Everything
// else (results that are not one tensor) goes back to Python's session._outputs_of.
//
// lowfp._C.intercept_setup(...) hands it, once, the Python objects the algorithm reads: the
// classification table and function, cuts, the SELECTING and GEMM name sets, torch.Tensor and the
// tag's attribute name. Their references are kept for the process's life.
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace lowfp::intercept {

namespace py = pybind11;

enum Kind : long { kPass = 0, kView = 1, kOp = 2 };  // lowfp._intercept's PASS, VIEW, OP

struct Objects {
  PyObject* classes = nullptr;    // dict: func -> (kind, short name)
  PyObject* classify = nullptr;   // classify(func) -> (kind, short name), for a func not in it
  PyObject* cuts = nullptr;       // cuts(t, index) -> bool
  PyObject* selecting = nullptr;  // frozenset SELECTING_NAMES
  PyObject* gemm_names = nullptr; // frozenset GEMM_NAMES
  PyObject* tensor = nullptr;     // torch.Tensor
  PyObject* parameter = nullptr;  // torch.nn.Parameter
  PyObject* tag = nullptr;        // the tag's attribute name
  // The emulation's rounding of a tensor (def_emulate.hpp's round_tensor: Emulator._round's eager
  // path), taken for a session whose class has _native_round true; null until emulator_round_setup.
  py::object (*round_tensor)(PyObject* session, PyObject* t, PyObject* name, PyObject* source,
                             bool is_new) = nullptr;
  // interned names
  PyObject *native_round, *params, *getitem, *setitem, *out, *serial, *writes, *module_stack, *repeats, *see, *source_of,
      *gemms, *output, *records, *op, *outputs_of, *is_floating_point, *v_prefix, *empty,
      *param_names, *param, *theta_prefix;
};

inline Objects& objects() {
  static Objects o;
  return o;
}

inline py::object steal(PyObject* p) {
  if (p == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(p);
}

inline bool truth(int r) {
  if (r < 0) throw py::error_already_set();
  return r != 0;
}

inline bool is_tensor(PyObject* a) {
  const Objects& o = objects();
  return Py_TYPE(a) == reinterpret_cast<PyTypeObject*>(o.tensor) || truth(PyObject_IsInstance(a, o.tensor));
}

// getattr(o, name, None) without building an AttributeError where the type's lookup is generic.
inline py::object optional_attr(PyObject* obj, PyObject* name) {
  PyObject* r = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int rc = PyObject_GetOptionalAttr(obj, name, &r);
#else
  const int rc = _PyObject_LookupAttr(obj, name, &r);
#endif
  if (rc < 0) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);  // (null: no such attribute)
}

inline py::object attr(PyObject* obj, PyObject* name) { return steal(PyObject_GetAttr(obj, name)); }

// Whether session's roundings take round_tensor (an Emulator's _native_round).
inline bool rounds_natively(PyObject* session) {
  const Objects& o = objects();
  return o.round_tensor != nullptr && attr(session, o.native_round).ptr() == Py_True;
}

inline bool same_str(PyObject* a, PyObject* b) {
  if (a == b) return true;
  if (!PyUnicode_Check(a)) return false;
  const int r = PyUnicode_Compare(a, b);
  if (r == -1 && PyErr_Occurred()) throw py::error_already_set();
  return r == 0;
}

// The TS name of t if its tag says it is a tensor of the forward numbered `serial` (borrowed from
// `keep`, which holds the tag), else null.
inline PyObject* tracked_name(PyObject* t, PyObject* serial, py::object& keep) {
  keep = optional_attr(t, objects().tag);
  PyObject* tag = keep.ptr();
  if (tag == nullptr || !PyTuple_Check(tag) || PyTuple_GET_SIZE(tag) < 2) return nullptr;
  PyObject* s = PyTuple_GET_ITEM(tag, 0);
  if (s != serial && !truth(PyObject_RichCompareBool(s, serial, Py_EQ))) return nullptr;
  return PyTuple_GET_ITEM(tag, 1);
}

inline void set_tag(PyObject* t, PyObject* serial, PyObject* name) {
  py::object tag = steal(PyTuple_Pack(2, serial, name));
  if (PyObject_SetAttr(t, objects().tag, tag.ptr()) < 0) throw py::error_already_set();
}

// ForwardSession._see(t, inputs, False) for a torch.nn.Parameter (the exact type) of the model
// that session.param_names names: "theta:<name>" appended to inputs, session._param's answer
// tagged unless it is t. Null where _see must answer (other tensors, parameters not named).
inline py::object see_parameter(PyObject* session, PyObject* t, PyObject* inputs, PyObject* serial) {
  const Objects& o = objects();
  if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(o.parameter)) return py::object();
  py::object names = attr(session, o.param_names);
  py::object id = steal(PyLong_FromVoidPtr(t));
  PyObject* pname = PyDict_GetItemWithError(names.ptr(), id.ptr());
  if (pname == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::object();
  }
  py::object name = steal(PyUnicode_Concat(o.theta_prefix, pname));
  if (PyList_Append(inputs, name.ptr()) < 0) throw py::error_already_set();
  py::object r;
  if (rounds_natively(session)) {  // Emulator._param: rounded at its first use in the forward
    py::object params = attr(session, o.params);
    PyObject* rounded = PyDict_GetItemWithError(params.ptr(), id.ptr());
    if (rounded == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (rounded != nullptr) {
      r = py::reinterpret_borrow<py::object>(rounded);
    } else {
      r = o.round_tensor(session, t, name.ptr(), Py_None, false);
      if (PyDict_SetItem(params.ptr(), id.ptr(), r.ptr()) < 0) throw py::error_already_set();
    }
  } else {
    r = steal(PyObject_CallMethodObjArgs(session, o.param, t, name.ptr(), Py_False, nullptr));
  }
  if (r.ptr() != t) set_tag(r.ptr(), serial, name.ptr());  // (never the user's Parameter)
  return r;
}

// ForwardSession._map_args(args, inputs, False): args (a tuple or list) with parameters (and
// other tensors that are not plain) replaced by session._see's answer; tracked tensors' names
// appended to inputs. Returns args itself when nothing was replaced.
inline py::object map_args(PyObject* session, PyObject* args, PyObject* inputs, PyObject* serial) {
  const Objects& o = objects();
  const bool is_list = PyList_Check(args);
  const Py_ssize_t n = is_list ? PyList_GET_SIZE(args) : PyTuple_GET_SIZE(args);
  py::object copy;  // a list, once something was replaced
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = is_list ? PyList_GET_ITEM(args, i) : PyTuple_GET_ITEM(args, i);
    py::object keep_a = py::reinterpret_borrow<py::object>(a);  // (a list may change under us)
    py::object r;
    if (is_tensor(a)) {
      py::object keep;
      if (PyObject* name = tracked_name(a, serial, keep)) {
        if (PyList_Append(inputs, name) < 0) throw py::error_already_set();
        continue;
      }
      if (Py_TYPE(a) == reinterpret_cast<PyTypeObject*>(o.tensor)) continue;  // (_see: as it is)
      r = see_parameter(session, a, inputs, serial);
      if (!r) r = steal(PyObject_CallMethodObjArgs(session, o.see, a, inputs, Py_False, nullptr));
    } else if (PyList_Check(a) || PyTuple_Check(a)) {
      const Py_ssize_t m = PyList_Check(a) ? PyList_GET_SIZE(a) : PyTuple_GET_SIZE(a);
      if (m == 0 || !is_tensor(PyList_Check(a) ? PyList_GET_ITEM(a, 0) : PyTuple_GET_ITEM(a, 0)))
        continue;
      r = map_args(session, a, inputs, serial);
    } else {
      continue;
    }
    if (r.ptr() == a) continue;
    if (!copy) copy = steal(PySequence_List(args));
    if (PyList_SetItem(copy.ptr(), i, r.release().ptr()) < 0) throw py::error_already_set();
  }
  if (!copy) return py::reinterpret_borrow<py::object>(args);
  return is_list ? copy : steal(PyList_AsTuple(copy.ptr()));
}

// lowfp._intercept.writes_in_place(fname, args, kwargs, out).
inline bool writes_in_place(PyObject* fname, PyObject* args, PyObject* kwargs, PyObject* out) {
  const Objects& o = objects();
  if (same_str(fname, o.setitem)) return true;
  if (kwargs != nullptr) {
    PyObject* given = PyDict_GetItemWithError(kwargs, o.out);
    if (given == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (given != nullptr && given != Py_None) return true;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  auto is_argument = [&](PyObject* t) {
    for (Py_ssize_t i = 0; i < n; ++i)
      if (PyTuple_GET_ITEM(args, i) == t) return true;
    return false;
  };
  if (is_tensor(out)) return is_argument(out);
  if (PyTuple_Check(out) || PyList_Check(out)) {
    py::object items = steal(PySequence_Tuple(out));
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(items.ptr()); ++j) {
      PyObject* t = PyTuple_GET_ITEM(items.ptr(), j);
      if (is_tensor(t) && is_argument(t)) return true;
    }
    return false;
  }
  return false;  // (a result that holds no tensor)
}

inline py::object call(PyObject* session, PyObject* func, PyObject* args_in, PyObject* kwargs_in) {
  const Objects& o = objects();
  if (o.classes == nullptr) throw std::runtime_error("lowfp._C.intercept_setup was not called");
  PyObject* kwargs = (kwargs_in != nullptr && kwargs_in != Py_None && PyDict_Check(kwargs_in) &&
                      PyDict_GET_SIZE(kwargs_in) > 0) ? kwargs_in : nullptr;
  py::object args = PyTuple_Check(args_in) ? py::reinterpret_borrow<py::object>(args_in)
                                           : steal(PySequence_Tuple(args_in));
  // classification
  py::object cls;
  PyObject* found = PyDict_GetItemWithError(o.classes, func);
  if (found != nullptr) {
    cls = py::reinterpret_borrow<py::object>(found);
  } else {
    if (PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
      PyErr_Clear();  // (an unhashable function: classify works it out each time)
    }
    cls = steal(PyObject_CallOneArg(o.classify, func));
  }
  long kind = PyLong_AsLong(PyTuple_GET_ITEM(cls.ptr(), 0));
  if (kind == -1 && PyErr_Occurred()) throw py::error_already_set();
  PyObject* fname = PyTuple_GET_ITEM(cls.ptr(), 1);
  if (kind == kPass) return steal(PyObject_Call(func, args.ptr(), kwargs));
  const Py_ssize_t nargs = PyTuple_GET_SIZE(args.ptr());
  if (nargs == 2 && same_str(fname, o.getitem)) {
    py::object c = steal(PyObject_CallFunctionObjArgs(o.cuts, PyTuple_GET_ITEM(args.ptr(), 0),
                                                      PyTuple_GET_ITEM(args.ptr(), 1), nullptr));
    if (truth(PyObject_IsTrue(c.ptr()))) kind = kOp;  // a partition
  }
  py::object serial = attr(session, o.serial);
  py::object inputs = steal(PyList_New(0));
  args = map_args(session, args.ptr(), inputs.ptr(), serial.ptr());
  py::object source = py::none();
  if (nargs > 0 && truth(PySet_Contains(o.selecting, fname)) && is_tensor(PyTuple_GET_ITEM(args.ptr(), 0)))
    source = steal(PyObject_CallMethodObjArgs(session, o.source_of, PyTuple_GET_ITEM(args.ptr(), 0), nullptr));
  py::object mapped_kwargs;
  if (kwargs != nullptr) {
    py::object values = steal(PyDict_Values(kwargs));
    py::object mapped = map_args(session, values.ptr(), inputs.ptr(), serial.ptr());
    if (mapped.ptr() != values.ptr()) {
      mapped_kwargs = steal(PyDict_New());
      PyObject *key, *value;
      Py_ssize_t pos = 0, i = 0;
      while (PyDict_Next(kwargs, &pos, &key, &value))
        if (PyDict_SetItem(mapped_kwargs.ptr(), key, PyList_GET_ITEM(mapped.ptr(), i++)) < 0)
          throw py::error_already_set();
      kwargs = mapped_kwargs.ptr();
    }
  }
  py::object out;
  py::object gemms = attr(session, o.gemms);
  if (!gemms.is_none() && truth(PySet_Contains(o.gemm_names, fname))) {
    py::object kw = kwargs != nullptr ? py::reinterpret_borrow<py::object>(kwargs) : steal(PyDict_New());
    out = steal(PyObject_CallFunctionObjArgs(gemms.ptr(), func, args.ptr(), kw.ptr(), nullptr));
    if (out.ptr() == Py_NotImplemented) out = py::object();
  }
  if (!out) out = steal(PyObject_Call(func, args.ptr(), kwargs));
  const bool wrote = kind == kOp && writes_in_place(fname, args.ptr(), kwargs, out.ptr());
  if (wrote) {
    py::object w = steal(PyNumber_Add(attr(session, o.writes).ptr(), py::int_(1).ptr()));
    if (PyObject_SetAttr(session, o.writes, w.ptr()) < 0) throw py::error_already_set();
  }
  if (PyList_GET_SIZE(inputs.ptr()) == 0) return out;  // a constant: computed from nothing tracked
  PyObject* t = out.ptr();
  if (!is_tensor(t)) {  // the rest of the call, in Python
    py::object kind_obj = steal(PyLong_FromLong(kind));
    return steal(PyObject_CallMethodObjArgs(session, o.outputs_of, t, kind_obj.ptr(), fname,
                                            inputs.ptr(), source.ptr(), wrote ? Py_True : Py_False,
                                            Py_False, nullptr));
  }
  if (!truth(PyObject_IsTrue(steal(PyObject_CallMethodNoArgs(t, o.is_floating_point)).ptr())))
    return out;
  if (kind == kView) {  // the same tensor of TS as its input
    set_tag(t, serial.ptr(), PyList_GET_ITEM(inputs.ptr(), 0));
    return out;
  }
  py::object stack = attr(session, o.module_stack);
  const Py_ssize_t depth = PyList_Check(stack.ptr()) ? PyList_GET_SIZE(stack.ptr()) : 0;
  py::object module = depth > 0 ? py::reinterpret_borrow<py::object>(PyList_GET_ITEM(stack.ptr(), depth - 1))
                                : py::reinterpret_borrow<py::object>(o.empty);
  const bool in_module = truth(PyObject_IsTrue(module.ptr()));
  py::object base = in_module ? steal(PyUnicode_FromFormat("%S:%S", module.ptr(), fname))
                              : py::reinterpret_borrow<py::object>(fname);
  py::object repeats = attr(session, o.repeats);
  PyObject* seen = PyDict_GetItemWithError(repeats.ptr(), base.ptr());
  if (seen == nullptr && PyErr_Occurred()) throw py::error_already_set();
  const long repeat = seen == nullptr ? 0 : PyLong_AsLong(seen);
  if (repeat == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (PyDict_SetItem(repeats.ptr(), base.ptr(), py::int_(repeat + 1).ptr()) < 0) throw py::error_already_set();
  py::object key = repeat == 0 ? base : steal(PyUnicode_FromFormat("%S#%ld", base.ptr(), repeat));
  py::object name = steal(PyUnicode_Concat(o.v_prefix, key.ptr()));
  py::object result = rounds_natively(session)
                          ? o.round_tensor(session, t, name.ptr(), source.ptr(), !wrote)
                          : steal(PyObject_CallMethodObjArgs(session, o.output, t, name.ptr(), source.ptr(),
                                                             wrote ? Py_False : Py_True, Py_False, nullptr));
  set_tag(result.ptr(), serial.ptr(), name.ptr());
  if (truth(PyObject_IsTrue(attr(session, o.records).ptr()))) {
    py::object names = steal(PyList_New(1));
    PyList_SET_ITEM(names.ptr(), 0, name.inc_ref().ptr());
    py::object tensors = steal(PyList_New(1));
    PyList_SET_ITEM(tensors.ptr(), 0, out.inc_ref().ptr());
    const bool is_gemm = truth(PySet_Contains(o.gemm_names, fname));
    steal(PyObject_CallMethodObjArgs(session, o.op, key.ptr(), fname, module.ptr(),
                                     is_gemm ? Py_True : Py_False, inputs.ptr(), names.ptr(),
                                     tensors.ptr(), nullptr));
  }
  return result;
}

// METH_FASTCALL: intercept_call(session, func, args, kwargs)
inline PyObject* call_fast(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4) {
    PyErr_SetString(PyExc_TypeError, "intercept_call(session, func, args, kwargs)");
    return nullptr;
  }
  try {
    return call(argv[0], argv[1], argv[2], argv[3]).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

inline PyObject* intern(const char* s) {
  PyObject* p = PyUnicode_InternFromString(s);
  if (p == nullptr) throw py::error_already_set();
  return p;  // (kept for the process's life)
}

// A setup function's keyword argument `name`, taken out of `given` (so that what is left over is
// unknown), its reference kept for the process's life; `setup` names the function in the error.
inline PyObject* take_kwarg(py::kwargs& given, const char* setup, const char* name) {
  if (!given.contains(name)) throw std::invalid_argument(std::string(setup) + ": no " + name + "=");
  py::object v = given[name];
  PyDict_DelItemString(given.ptr(), name);
  return v.release().ptr();
}

// Raises where `given` holds keyword arguments that take_kwarg did not take.
inline void check_all_taken(py::kwargs& given, const char* setup) {
  if (PyDict_Size(given.ptr()) != 0)
    throw std::invalid_argument(std::string(setup) + ": unknown " + py::str(py::list(given)).cast<std::string>());
}

inline void def_intercept(py::module_& mod) {
  mod.def("intercept_setup", [](py::dict classes, py::object classify, py::object cuts,
                                py::object selecting, py::object gemm_names, py::object tensor,
                                py::object parameter, py::str tag, py::tuple kinds) {
    if (kinds.size() != 3 || kinds[0].cast<long>() != kPass || kinds[1].cast<long>() != kView ||
        kinds[2].cast<long>() != kOp)
      throw std::invalid_argument("intercept_setup: kinds must be (PASS, VIEW, OP) = (0, 1, 2)");
    Objects& o = objects();
    o.classes = classes.inc_ref().ptr();
    o.classify = classify.inc_ref().ptr();
    o.cuts = cuts.inc_ref().ptr();
    o.selecting = selecting.inc_ref().ptr();
    o.gemm_names = gemm_names.inc_ref().ptr();
    o.tensor = tensor.inc_ref().ptr();
    o.parameter = parameter.inc_ref().ptr();
    o.native_round = intern("_native_round");
    o.params = intern("_params");
    o.param_names = intern("param_names");
    o.param = intern("_param");
    o.theta_prefix = intern("theta:");
    o.tag = intern(std::string(tag).c_str());
    o.getitem = intern("__getitem__");
    o.setitem = intern("__setitem__");
    o.out = intern("out");
    o.serial = intern("serial");
    o.writes = intern("writes");
    o.module_stack = intern("_module_stack");
    o.repeats = intern("_repeats");
    o.see = intern("_see");
    o.source_of = intern("_source_of");
    o.gemms = intern("gemms");
    o.output = intern("_output");
    o.records = intern("_records_operators");
    o.op = intern("_operator");
    o.outputs_of = intern("_outputs_of");
    o.is_floating_point = intern("is_floating_point");
    o.v_prefix = intern("v:");
    o.empty = intern("");
  });
  static PyMethodDef methods[] = {
      {"intercept_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&call_fast)),
       METH_FASTCALL,
       "intercept_call(session, func, args, kwargs): ForwardSession.call's eager path"},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(mod.ptr(), methods) < 0) throw py::error_already_set();
}

}  // namespace lowfp::intercept

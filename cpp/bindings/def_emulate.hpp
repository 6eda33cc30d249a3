// lowfp._C.emulator_round(session, t, name, source, new): the eager path of
// lowfp.emulate.Emulator._round, which lowfp._C.intercept_call takes for an operator's output and
// a parameter's first use where the session's class says so (Emulator._native_round). The Python
// method is the definition (and what torch.compile traces); this is the same algorithm step for
// step: the tensor's entry looked up, its rounding in its own memory with its gradient's tensor
// hook, or lowfp's autograd Function, or the bound rounding alone; a skipped rounding counted; the
// result marked. A session with an observer, and a name the recorded step lacks, take the Python
// method.
//
// A BoundRounder's call (its rounding, or its rounding in place) is lowfp._C.round_bound where the
// kernel adds to the rounder's counts (BoundRounder._counts), and where that does not take the tensor,
// the BoundRounder's own method; a gradient's tensor hook is registered as
// emulate._add_gradient_hook registers it, without its Python frame; a node type that
// emulate._node_saves_no_result has answered for is answered from that table.
//
// lowfp._C.emulator_round_setup(...) hands it, once, the Python objects it calls (kept for the
// process's life).
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "def_intercept.hpp"

namespace lowfp::emulate_round {

namespace py = pybind11;
using intercept::attr;
using intercept::intern;
using intercept::steal;
using intercept::truth;

struct Objects {
  PyObject* tensor = nullptr;             // torch.Tensor
  PyObject* is_grad_enabled = nullptr;    // torch.is_grad_enabled
  PyObject* round_apply = nullptr;        // emulate._round_apply(t, kernel, bwd, observe)
  PyObject* count_unchanged = nullptr;    // emulate._count_unchanged(counts, t)
  PyObject* add_gradient_hook = nullptr;  // emulate._add_gradient_hook(t, hook)
  PyObject* rounds_in_place = nullptr;    // emulate._rounds_in_place(t)
  PyObject* saves_no_result = nullptr;    // emulate._node_saves_no_result (node type -> answer)
  PyObject* ordered_dict = nullptr;       // collections.OrderedDict
  PyObject* hooks_key = nullptr;          // emulate._HOOKS_KEY
  PyObject* mark = nullptr;               // emulate._MARK
  PyObject* round_bound = nullptr;        // lowfp._C.round_bound
  // interned names
  PyObject *round, *observer, *counting, *entries, *uncounted, *requires_grad, *is_leaf, *base, *grad_fn,
      *backward_hooks, *register_hook_dict, *counts_slot, *counts_device, *requests, *round_in_place, *counts, *serial, *writes;
  bool lean_hooks = true;  // emulate._lean_hooks: false once a torch lacked the lean registration
};

inline Objects& objects() {
  static Objects o;
  return o;
}

inline py::object borrow(PyObject* p) { return py::reinterpret_borrow<py::object>(p); }

// The tensor rounded by the BoundRounder `bound` (out: x itself, in place, or None: a new tensor),
// or None where round_bound does not take it (nothing done).
inline py::object bound_native(PyObject* bound, PyObject* x, PyObject* out) {
  const Objects& o = objects();
  py::object counts = attr(bound, o.counts_slot);
  if (counts.ptr() == Py_None) return py::none();
  py::object requests = attr(bound, o.requests), counts_device = attr(bound, o.counts_device);
  PyObject* argv[5] = {requests.ptr(), x, counts.ptr(), counts_device.ptr(), out};
  return steal(PyObject_Vectorcall(o.round_bound, argv, 5, nullptr));
}

// bound(x): BoundRounder.__call__.
inline py::object bound_call(PyObject* bound, PyObject* x) {
  py::object y = bound_native(bound, x, Py_None);
  if (y.ptr() != Py_None) return y;
  return steal(PyObject_CallOneArg(bound, x));
}

// bound.round_in_place(x)
inline bool bound_in_place(PyObject* bound, PyObject* x) {
  if (bound_native(bound, x, x).ptr() != Py_None) return true;
  return truth(PyObject_IsTrue(steal(PyObject_CallMethodOneArg(bound, objects().round_in_place, x)).ptr()));
}

// emulate._rounds_in_place(t), answered here for a node type the table holds a bool for.
inline bool rounds_in_place(PyObject* t) {
  const Objects& o = objects();
  if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(o.tensor)) return false;
  if (attr(t, o.base).ptr() != Py_None) return false;
  py::object node = attr(t, o.grad_fn);
  PyObject* ok = PyDict_GetItemWithError(o.saves_no_result, reinterpret_cast<PyObject*>(Py_TYPE(node.ptr())));
  if (ok == nullptr && PyErr_Occurred()) throw py::error_already_set();
  if (ok == Py_True) return true;
  if (ok == Py_False) return false;
  return truth(PyObject_IsTrue(steal(PyObject_CallOneArg(o.rounds_in_place, t)).ptr()));
}

// emulate._add_gradient_hook(t, hook)
inline void add_gradient_hook(PyObject* t, PyObject* hook) {
  Objects& o = objects();
  if (o.lean_hooks && attr(t, o.backward_hooks).ptr() == Py_None) {
    py::object hooks = steal(PyObject_CallNoArgs(o.ordered_dict));
    if (PyObject_SetItem(hooks.ptr(), o.hooks_key, hook) < 0) throw py::error_already_set();
    if (PyObject_SetAttr(t, o.backward_hooks, hooks.ptr()) == 0) {
      py::object node = attr(t, o.grad_fn);
      PyObject* done = PyObject_CallMethodOneArg(node.ptr(), o.register_hook_dict, t);
      if (done != nullptr) {
        Py_DECREF(done);
        return;
      }
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
    PyErr_Clear();  // (a torch without the lean registration: the Python function decides)
    if (PyObject_SetAttr(t, o.backward_hooks, Py_None) < 0) throw py::error_already_set();
    o.lean_hooks = false;
  }
  steal(PyObject_CallFunctionObjArgs(o.add_gradient_hook, t, hook, nullptr));
}

// Emulator._round(t, name, source, new, compiling=False)
inline py::object round_tensor(PyObject* session, PyObject* t, PyObject* name, PyObject* source, bool is_new) {
  const Objects& o = objects();
  if (o.tensor == nullptr) throw std::runtime_error("lowfp._C.emulator_round_setup was not called");
  auto python = [&] {
    return steal(PyObject_CallMethodObjArgs(session, o.round, t, name, source, is_new ? Py_True : Py_False,
                                            Py_False, nullptr));
  };
  if (attr(session, o.observer).ptr() != Py_None) return python();
  const bool counting = truth(PyObject_IsTrue(attr(session, o.counting).ptr()));
  py::object entries = attr(session, counting ? o.entries : o.uncounted);
  PyObject* found = PyDict_GetItemWithError(entries.ptr(), name);
  if (found == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return python();  // (a name the recorded step lacks: _unrecorded warns once)
  }
  py::object entry = borrow(found);
  if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 8)
    throw std::runtime_error("emulator_round: an entry is emulate._entry's 8-tuple");
  PyObject* fwd = PyTuple_GET_ITEM(found, 0);
  PyObject* fs = PyTuple_GET_ITEM(found, 1);
  PyObject* bwd = PyTuple_GET_ITEM(found, 2);
  PyObject* fwd_bound = PyTuple_GET_ITEM(found, 4);
  PyObject* bwd_bound = PyTuple_GET_ITEM(found, 5);
  PyObject* hookable = PyTuple_GET_ITEM(found, 6);
  PyObject* marked = PyTuple_GET_ITEM(found, 7);
  if (fwd == Py_None && bwd == Py_None) return borrow(t);
  const bool unchanged = source != Py_None && source == fwd && Py_TYPE(t) == reinterpret_cast<PyTypeObject*>(o.tensor);
  py::object out;
  if (attr(t, o.requires_grad).ptr() == Py_True &&
      truth(PyObject_IsTrue(steal(PyObject_CallNoArgs(o.is_grad_enabled)).ptr()))) {
    PyObject* kernel = unchanged ? Py_None : fwd_bound;
    bool hooked = truth(PyObject_IsTrue(hookable)) && attr(t, o.is_leaf).ptr() != Py_True;
    if (hooked && kernel != Py_None) hooked = is_new && rounds_in_place(t) && bound_in_place(kernel, t);
    if (hooked) {
      out = borrow(t);
      if (bwd_bound != Py_None) add_gradient_hook(t, bwd_bound);
    } else {
      out = steal(PyObject_CallFunctionObjArgs(o.round_apply, t, kernel, bwd_bound, Py_None, nullptr));
    }
  } else if (unchanged || fwd_bound == Py_None) {
    out = borrow(t);
  } else {
    out = bound_call(fwd_bound, t);
  }
  if (unchanged && fs != Py_None)
    steal(PyObject_CallFunctionObjArgs(o.count_unchanged, attr(fs, o.counts).ptr(), t, nullptr));
  if (truth(PyObject_IsTrue(marked))) {
    py::object serial = attr(session, o.serial), writes = attr(session, o.writes);
    py::object tag = steal(PyTuple_Pack(3, serial.ptr(), writes.ptr(), fwd));
    if (PyObject_SetAttr(out.ptr(), o.mark, tag.ptr()) < 0) throw py::error_already_set();
  }
  return out;
}

inline void def_emulate(py::module_& mod) {
  // The objects, by name: tensor (torch.Tensor), is_grad_enabled, round_apply, count_unchanged,
  // add_gradient_hook, rounds_in_place, saves_no_result, ordered_dict, hooks_key, mark,
  // round_bound (emulate's and lowfp._C's, as Objects says).
  mod.def("emulator_round_setup", [](py::kwargs given) {
    auto take = [&given](const char* name) { return intercept::take_kwarg(given, "emulator_round_setup", name); };
    Objects o;  // (published whole, below, once every name was given)
    o.tensor = take("tensor");
    o.is_grad_enabled = take("is_grad_enabled");
    o.round_apply = take("round_apply");
    o.count_unchanged = take("count_unchanged");
    o.add_gradient_hook = take("add_gradient_hook");
    o.rounds_in_place = take("rounds_in_place");
    o.saves_no_result = take("saves_no_result");
    if (!PyDict_Check(o.saves_no_result)) throw std::invalid_argument("emulator_round_setup: saves_no_result is a dict");
    o.ordered_dict = take("ordered_dict");
    o.hooks_key = take("hooks_key");
    o.mark = take("mark");
    o.round_bound = take("round_bound");
    intercept::check_all_taken(given, "emulator_round_setup");
    o.round = intern("_round");
    o.observer = intern("observer");
    o.counting = intern("_counting");
    o.entries = intern("_entries");
    o.uncounted = intern("_uncounted");
    o.requires_grad = intern("requires_grad");
    o.is_leaf = intern("is_leaf");
    o.base = intern("_base");
    o.grad_fn = intern("grad_fn");
    o.backward_hooks = intern("_backward_hooks");
    o.register_hook_dict = intern("_register_hook_dict");
    o.counts_slot = intern("_counts");
    o.counts_device = intern("_counts_device");
    o.requests = intern("_requests");
    o.round_in_place = intern("round_in_place");
    o.counts = intern("counts");
    o.serial = intern("serial");
    o.writes = intern("writes");
    objects() = o;
    intercept::objects().round_tensor = &round_tensor;
  });
  static PyMethodDef methods[] = {
      {"emulator_round",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             if (argc != 5) {
               PyErr_SetString(PyExc_TypeError, "emulator_round(session, t, name, source, new)");
               return nullptr;
             }
             try {
               const bool is_new = truth(PyObject_IsTrue(argv[4]));
               return round_tensor(argv[0], argv[1], argv[2], argv[3], is_new).release().ptr();
             } catch (py::error_already_set& e) {
               e.restore();
             } catch (const std::exception& e) {
               PyErr_SetString(PyExc_RuntimeError, e.what());
             }
             return nullptr;
           })),
       METH_FASTCALL, "emulator_round(session, t, name, source, new): Emulator._round's eager path"},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(mod.ptr(), methods) < 0) throw py::error_already_set();
}

}  // namespace lowfp::emulate_round

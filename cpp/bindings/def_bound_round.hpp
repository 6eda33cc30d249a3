// lowfp._C.round_bound(requests, x, counts, counts_device, out): lowfp.quantize.BoundRounder's
// one native call, in C: where x is a plain, contiguous tensor of a dtype that `requests` (dict:
// torch.dtype -> PreparedQuantize) holds, on that request's backend (a CPU tensor that
// backends.ready_on_cpu passes, or a CUDA tensor), round it by that request into `out` (None: a
// new tensor like x, as _memory.new_output makes it), adding its counts at the address `counts`
// (0: none), which must lie on x's device (`counts_device`: -1 for the CPU, else the CUDA device
// index); the result, or None where the call does not take x (nothing was done).
//
// lowfp._C.round_remembered(request, dtype, x, stats, seed, generator, offset, out):
// lowfp.quantize's remembered call of a plain format (PreparedFormat.round) in C, where x is a
// plain, contiguous tensor on request's backend that runs_natively passes (no autograd to record,
// no mode or transform that must see lowfp's operator), stats is None or a lowfp.Stats on x's
// device, and the seed comes from `seed` or a CPU generator (None: torch's default): x rounded
// into `out` (which the caller checked: quantize's _writable_in_one_call) or, for None, a new
// tensor of `dtype`; None, with nothing drawn or written, for any other call (the Python path
// decides it, or raises).
//
// lowfp._C.eager_key(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype): the key of
// quantize's table of remembered calls (quantize._EAGER), from the arguments as the caller passed
// them.
//
// lowfp._C.quantize_remembered(table, x, fmt, rounding, overflow, subnormals, seed, generator,
// offset, sr_bits, stats, out, out_dtype, grad_fmt): lowfp.quantize's look-up of a remembered
// call, with its arguments in quantize's order. None where the call cannot be remembered (x not a
// plain tensor or Parameter, out= not one, a generator that is not a torch.Generator, an offset outside
// [0, 2^64), grad_fmt) or is not (its key is unhashable or absent); the result where
// round_remembered takes it, or, for an x whose result autograd records (no out=), the same checks
// and the prepared rounding recorded straight through (record_remembered: in torch's clone of a
// small CPU x, else in lowfp's autograd Function, quantize._remembered_apply); else the table's
// entry, which the Python path runs.
//
// lowfp._C.round_scaled(entry, x, counts, seed, generator, offset, out): a scaled format's
// prepared rounding (lowfp.scaled.quantize.PreparedScaled.round) in C where its blocks lie along
// the last axis; quantize_remembered runs a remembered scaled call by it too.
//
// CUDA tensors run lowfp._C_cuda's kernels (rounding_kernels.hpp) on torch's current stream of
// their device, as backends.native finds it, and nothing waits for them.
//
// A stochastic request draws its seed as lowfp._native.draw_seed_eager does, from the calling
// thread's buffer (the same words and generator advance), unless the call gives `seed`.
//
// lowfp._C.round_bound_setup(**objects) hands them, once, the Python objects they call (kept for
// the process's life); see def_bound_round for the names.
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "def_intercept.hpp"
#include "def_quantize.hpp"
#include "rounding_kernels.hpp"

namespace lowfp::bound_round {

namespace py = pybind11;
using intercept::attr;
using intercept::steal;
using intercept::truth;

struct Objects {
  PyObject* tensor = nullptr;      // torch.Tensor
  PyObject* parameter = nullptr;   // torch.nn.Parameter
  PyObject* stats_type = nullptr;  // lowfp.Stats
  PyObject* ready_on_cpu = nullptr;
  PyObject* empty_like = nullptr;
  PyObject* new_output = nullptr;  // new_output(like, dtype, memory_format), from min_bytes on
  PyObject* preserve_format = nullptr;
  int64_t min_bytes = 0;
  PyObject* backends = nullptr;       // lowfp.backends (its _torch_threads)
  PyObject* get_num_threads = nullptr;
  PyObject* strided = nullptr;        // torch.strided
  // lowfp._native.draw_buffer(): the calling thread's (words, view, words.random_, address)
  PyObject* draw_buffer = nullptr;
  // no-argument calls whose answers must be false (or 0) for a remembered call to skip the
  // operator: torch.is_grad_enabled is asked only of an x that requires grad
  PyObject* is_grad_enabled = nullptr;
  PyObject* unobserved[3] = {nullptr, nullptr, nullptr};  // function mode, dispatch stack, functorch
  PyObject* generator_type = nullptr;        // torch.Generator
  PyObject* cpu_device = nullptr;            // torch.device("cpu")
  PyObject* prepared_format = nullptr;       // lowfp._prepared.PreparedFormat
  PyObject* writable_in_one_call = nullptr;  // lowfp.quantize._writable_in_one_call(x, out)
  PyObject* generator_keyword = nullptr;     // ("generator",): random_'s keyword
  PyObject* remembered_apply = nullptr;      // lowfp.quantize._remembered_apply
  PyObject* prepared_scaled = nullptr;       // lowfp.scaled.quantize.PreparedScaled
  PyObject* scaled_stats_type = nullptr;     // lowfp.scaled.ScaledStats
  PyObject* device_scratch = nullptr;        // (x, n) -> a new float64 tensor of n elements on x's device
  // lowfp._C's kernels, lowfp._C_cuda's (nullptr: no CUDA build) and torch's raw accessor of a
  // CUDA device's current stream, torch._C._cuda_getCurrentRawStream (nullptr: a torch without CUDA)
  const RoundingKernels* cpu = nullptr;
  const RoundingKernels* cuda = nullptr;
  PyObject* cuda_raw_stream = nullptr;
  PyObject *dtype, *is_contiguous, *data_ptr, *numel, *element_size, *is_cpu, *is_cuda, *is_nested, *layout,
      *torch_threads, *requires_grad, *counts, *request, *device, *clone, *get_device, *shape, *last_axis_block,
      *stochastic;
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

// The seed of a stochastic call without one: the next two words of `generator` (a CPU
// torch.Generator, or None: torch's default), as lowfp._native.draw_seed_eager draws them
// (random_() into the thread's int64 buffer, the low 32 bits of each word).
inline uint64_t draw_seed(PyObject* generator) {
  const Objects& o = objects();
  py::object buffer = steal(PyObject_CallNoArgs(o.draw_buffer));
  if (!PyTuple_Check(buffer.ptr()) || PyTuple_GET_SIZE(buffer.ptr()) != 4)
    throw std::runtime_error("lowfp._native.draw_buffer must return (words, view, random_, address)");
  PyObject* random_ = PyTuple_GET_ITEM(buffer.ptr(), 2);
  if (generator == Py_None) {
    steal(PyObject_CallNoArgs(random_));
  } else {  // random_(generator=generator)
    PyObject* args[2] = {nullptr, generator};
    steal(PyObject_Vectorcall(random_, args + 1, 0 | PY_VECTORCALL_ARGUMENTS_OFFSET, o.generator_keyword));
  }
  const auto* words = reinterpret_cast<const int64_t*>(
      as_int(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(buffer.ptr(), 3))));
  return (uint64_t(words[0]) & 0xffffffffu) | ((uint64_t(words[1]) & 0xffffffffu) << 32);
}

inline int64_t numel_of(PyObject* x) { return as_int(steal(PyObject_CallMethodNoArgs(x, objects().numel))); }

// Where a prepared call runs: lowfp._C's CPU kernel, or lowfp._C_cuda's on a CUDA device,
// enqueued on torch's current stream of that device (as backends.native finds it).
struct Placement {
  bool cuda = false;
  int32_t device = -1;  // (-1: the CPU)
  uintptr_t stream = 0;
};

// out, or where None, a new tensor of x's shape (n elements) and layout and of `dtype`, as
// _memory.new_output makes it.
inline py::object result_for(PyObject* x, int64_t n, PyObject* x_dtype, PyObject* dtype, PyObject* out) {
  const Objects& o = objects();
  if (out != Py_None) return py::reinterpret_borrow<py::object>(out);
  if (dtype == x_dtype && n * as_int(steal(PyObject_CallMethodNoArgs(x, o.element_size))) < o.min_bytes)
    return steal(PyObject_CallOneArg(o.empty_like, x));
  return steal(PyObject_CallFunctionObjArgs(o.new_output, x, dtype, o.preserve_format, nullptr));
}

// The prepared call on x (a plain contiguous tensor of n elements where `at` runs it, checked by
// the caller: placed) into out (None: result_for's new tensor of dtype), adding counts at
// count_at (0: none), keyed by *seed (nullptr: drawn here from `generator` when the call is
// stochastic).
inline py::object run_prepared(QuantizeCall call, const Placement& at, PyObject* x, int64_t n, PyObject* x_dtype,
                               PyObject* dtype, int64_t count_at, PyObject* out, const uint64_t* seed,
                               PyObject* generator, uint64_t offset) {
  const Objects& o = objects();
  py::object y = result_for(x, n, x_dtype, dtype, out);
  const bool stochastic = call.mode == Rounding::Stochastic;
  call.seed = !stochastic ? 0 : seed != nullptr ? *seed : draw_seed(generator);
  call.offset = offset;
  call.x = reinterpret_cast<const void*>(as_int(steal(PyObject_CallMethodNoArgs(x, o.data_ptr))));
  call.y = reinterpret_cast<void*>(as_int(steal(PyObject_CallMethodNoArgs(y.ptr(), o.data_ptr))));
  call.n = n;
  call.count = count_at != 0;
  {
    py::gil_scoped_release release;
    (at.cuda ? o.cuda : o.cpu)->run(call, reinterpret_cast<int64_t*>(count_at), at.device, at.stream);
  }
  return y;
}

// The QuantizeCall of request, a PreparedQuantize of lowfp._C (*on_cuda false) or of
// lowfp._C_cuda (*on_cuda true); false for anything else.
inline bool prepared_call(PyObject* request, QuantizeCall& call, bool& on_cuda) {
  const Objects& o = objects();
  on_cuda = false;
  if (o.cpu->prepared_call(request, &call)) return true;
  on_cuda = true;
  return o.cuda != nullptr && o.cuda->prepared_call(request, &call);
}

inline bool plain_tensor(PyObject* x) {
  const Objects& o = objects();
  PyTypeObject* type = Py_TYPE(x);
  return type == reinterpret_cast<PyTypeObject*>(o.tensor) || type == reinterpret_cast<PyTypeObject*>(o.parameter);
}

inline bool contiguous(PyObject* x) {
  return truth(PyObject_IsTrue(steal(PyObject_CallMethodNoArgs(x, objects().is_contiguous)).ptr()));
}

// Whether x, a plain tensor, is one that a prepared call of its backend (on_cuda: lowfp._C_cuda's)
// reads in one pass: on the CPU, contiguous and passing ready_on_cpu; on CUDA, a strided, not
// nested, contiguous CUDA tensor, whose device and current stream go into *at.
inline bool placed(PyObject* x, bool on_cuda, Placement& at) {
  const Objects& o = objects();
  at = Placement{};
  if (!on_cuda) return ready_on_cpu(x) && contiguous(x);
  if (o.cuda_raw_stream == nullptr || attr(x, o.is_cuda).ptr() != Py_True ||
      attr(x, o.is_nested).ptr() != Py_False || attr(x, o.layout).ptr() != o.strided || !contiguous(x))
    return false;
  py::object device = steal(PyObject_CallMethodNoArgs(x, o.get_device));
  at.cuda = true;
  at.device = static_cast<int32_t>(as_int(device));
  at.stream = static_cast<uintptr_t>(as_int(steal(PyObject_CallOneArg(o.cuda_raw_stream, device.ptr()))));
  return true;
}

// Whether `counts` (a Stats' tensor) lives where `at` runs, so its kernel adds to it.
inline bool counts_at(PyObject* counts, const Placement& at) {
  const Objects& o = objects();
  if (!at.cuda) return attr(counts, o.is_cpu).ptr() == Py_True;
  return attr(counts, o.is_cuda).ptr() == Py_True &&
         as_int(steal(PyObject_CallMethodNoArgs(counts, o.get_device))) == at.device;
}

inline py::object round_bound(PyObject* requests, PyObject* x, PyObject* counts, PyObject* counts_device, PyObject* out) {
  const Objects& o = objects();
  if (o.tensor == nullptr) throw std::runtime_error("lowfp._C.round_bound_setup was not called");
  if (!PyDict_Check(requests)) {
    PyErr_SetString(PyExc_TypeError, "round_bound: requests must be a dict");
    throw py::error_already_set();
  }
  if (!plain_tensor(x)) return py::none();
  py::object dtype = attr(x, o.dtype);
  PyObject* request = PyDict_GetItemWithError(requests, dtype.ptr());
  if (request == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::none();
  }
  py::object keep_request = py::reinterpret_borrow<py::object>(request);
  QuantizeCall call;
  bool on_cuda = false;
  Placement at;
  if (!prepared_call(request, call, on_cuda) || !placed(x, on_cuda, at)) return py::none();
  const int64_t count_at = as_int(py::reinterpret_borrow<py::object>(counts));
  if (count_at != 0 && as_int(py::reinterpret_borrow<py::object>(counts_device)) != at.device)
    return py::none();  // (counts on another device than x: the rounder's own call decides)
  return run_prepared(call, at, x, numel_of(x), dtype.ptr(), dtype.ptr(), count_at, out, nullptr, Py_None, 0);
}

// Whether a call of no arguments answers false (or 0).
inline bool answers_no(PyObject* fn) { return !truth(PyObject_IsTrue(steal(PyObject_CallNoArgs(fn)).ptr())); }

// An int in [0, 2**64) into *v; false for anything else (with no Python error left).
inline bool as_uint64(PyObject* v, uint64_t& r) {
  if (!PyLong_CheckExact(v)) return false;
  r = PyLong_AsUnsignedLongLong(v);
  if (r == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // (negative, or 2**64 and above: the Python path raises)
    return false;
  }
  return true;
}

// Whether `generator` (a torch.Generator) draws on the CPU: its device equals torch.device("cpu")
// (a device's comparison costs less than making its type's string; a "cpu:0" generator, unequal,
// takes the Python path). A generator's device never changes, so the last CPU generator is
// remembered by a weak reference: a loop that passes one generator makes its device once (making
// a torch.device costs about half a draw). A freed generator's reference answers None, so a new
// generator at its address is asked again. Where torch.Generator takes no weak reference (torch
// 2.11), nothing is remembered.
inline bool cpu_generator(PyObject* generator) {
  static PyObject* last_cpu = nullptr;  // a weak reference, or nullptr
  if (last_cpu != nullptr) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* held = nullptr;
    if (PyWeakref_GetRef(last_cpu, &held) < 0) throw py::error_already_set();
    Py_XDECREF(held);  // only its address is compared
#else
    PyObject* held = PyWeakref_GetObject(last_cpu);
#endif
    if (held == generator) return true;
  }
  py::object device = attr(generator, objects().device);
  if (!truth(PyObject_RichCompareBool(device.ptr(), objects().cpu_device, Py_EQ))) return false;
  if (!PyType_SUPPORTS_WEAKREFS(Py_TYPE(generator))) return true;
  PyObject* fresh = PyWeakref_NewRef(generator, nullptr);
  if (fresh == nullptr) throw py::error_already_set();
  Py_XSETREF(last_cpu, fresh);
  return true;
}

// Whether a call's seed arguments take the C path, as remembered_seed (lowfp._native) takes them:
// seed= alone, an int in [0, 2^64) (*has_seed, *seed), or none, drawn from a torch.Generator on
// the CPU (None: torch's default) where the call is stochastic.
inline bool seed_args(PyObject* seed_arg, PyObject* generator, bool stochastic, bool& has_seed, uint64_t& seed) {
  has_seed = seed_arg != Py_None;
  if (has_seed && (generator != Py_None || !as_uint64(seed_arg, seed))) return false;
  return generator == Py_None ||
         (Py_TYPE(generator) == reinterpret_cast<PyTypeObject*>(objects().generator_type) &&
          (!stochastic || cpu_generator(generator)));
}

// A remembered call's arguments, checked as the Python path's remembered calls check them.
struct RememberedArgs {
  Placement at;
  bool recorded = false;  // x requires grad and grad mode is on: lowfp's autograd Function records it
  py::object counts;      // stats.counts (None: no stats)
  int64_t count_at = 0;   // its address (0: none)
  int64_t counts_size = 0;  // its elements: 4 (a Stats), 6 (a ScaledStats)
  bool has_seed = false;  // seed= given (else drawn from the generator, where stochastic)
  uint64_t seed = 0, offset = 0;  // (offset: checked by the caller)
};

// Whether x and the rest of a call of a request on the CPU (on_cuda false) or lowfp._C_cuda, a
// stochastic one or not, take the C path: x a plain contiguous tensor on the request's backend
// (placed), nothing that must see lowfp's operator (a mode or functorch transform; autograd sets
// a.recorded: records_natively rather than runs_natively), stats None or a Stats (or, for a
// scaled request, a ScaledStats) whose counts live on x's device, and the seed as
// remembered_seed (lowfp._native) takes it: seed= alone, or drawn from a CPU generator (None:
// torch's default). The offset is the caller's, already in [0, 2^64).
inline bool remembered_args(PyObject* x, bool on_cuda, bool stochastic, bool scaled, PyObject* stats,
                            PyObject* seed_arg, PyObject* generator, uint64_t offset, RememberedArgs& a) {
  const Objects& o = objects();
  if (!plain_tensor(x)) return false;
  a.recorded = attr(x, o.requires_grad).ptr() == Py_True && !answers_no(o.is_grad_enabled);
  for (PyObject* fn : o.unobserved)
    if (!answers_no(fn)) return false;
  if (!placed(x, on_cuda, a.at)) return false;
  a.counts = py::none();
  if (stats != Py_None) {
    if (Py_TYPE(stats) != reinterpret_cast<PyTypeObject*>(o.stats_type) &&
        !(scaled && Py_TYPE(stats) == reinterpret_cast<PyTypeObject*>(o.scaled_stats_type)))
      return false;
    a.counts = attr(stats, o.counts);
    if (!counts_at(a.counts.ptr(), a.at)) return false;
    a.count_at = as_int(steal(PyObject_CallMethodNoArgs(a.counts.ptr(), o.data_ptr)));
    a.counts_size = numel_of(a.counts.ptr());
  }
  if (!seed_args(seed_arg, generator, stochastic, a.has_seed, a.seed)) return false;
  a.offset = offset;
  return true;
}

// A plain format's request and its call, checked with a call's arguments (remembered_args).
struct RememberedFormat {
  QuantizeCall call;
  RememberedArgs args;
};

inline bool remembered_format(PyObject* request, PyObject* x, PyObject* stats, PyObject* seed_arg, PyObject* generator,
                              uint64_t offset, RememberedFormat& r) {
  if (objects().tensor == nullptr) throw std::runtime_error("lowfp._C.round_bound_setup was not called");
  bool on_cuda = false;
  return prepared_call(request, r.call, on_cuda) &&
         remembered_args(x, on_cuda, r.call.mode == Rounding::Stochastic, false, stats, seed_arg, generator, offset,
                         r.args);
}

// The checked call (not recorded) run into out (None: a new tensor of dtype).
inline py::object run_remembered(const RememberedFormat& r, PyObject* dtype, PyObject* x, PyObject* generator,
                                 PyObject* out) {
  const RememberedArgs& a = r.args;
  py::object x_dtype = attr(x, objects().dtype);
  return run_prepared(r.call, a.at, x, numel_of(x), x_dtype.ptr(), dtype, a.count_at, out,
                      a.has_seed ? &a.seed : nullptr, generator, a.offset);
}

inline py::object round_remembered(PyObject* request, PyObject* dtype, PyObject* x, PyObject* stats,
                                   PyObject* seed_arg, PyObject* generator, PyObject* offset_arg, PyObject* out) {
  RememberedFormat r;
  uint64_t offset = 0;
  if (!as_uint64(offset_arg, offset) || !remembered_format(request, x, stats, seed_arg, generator, offset, r) ||
      r.args.recorded)
    return py::none();
  return run_remembered(r, dtype, x, generator, out);
}

// A checked call whose result autograd records (no out=). Where the result keeps x's dtype and x
// is a CPU tensor of at most kCloneRoundBytes, x's copy by torch's clone (a node that saves nothing and passes
// the gradient straight through, recorded by torch in C++) is rounded in place: the operator's
// formula for a call without grad_fmt, for less than lowfp's Python autograd Function costs. A
// larger x would pay the copy's pass over memory more than the Function's call, so it takes the
// Function as _round_remembered makes it: _remembered_apply(x, entry, stats, counts, seed, offset),
// the seed drawn here. (On a GPU the copy is a kernel launch of its own, whose host cost has not
// been weighed against the Function's: CUDA tensors take the Function.)
constexpr int64_t kCloneRoundBytes = int64_t(1) << 16;

inline py::object record_remembered(const RememberedFormat& r, PyObject* entry, PyObject* x, PyObject* stats,
                                    PyObject* generator) {
  const Objects& o = objects();
  const RememberedArgs& a = r.args;
  py::object x_dtype = attr(x, o.dtype), dtype = attr(entry, o.dtype);
  if (x_dtype.ptr() == dtype.ptr() && !a.at.cuda) {  // (torch.dtype objects are one per dtype)
    const int64_t n = numel_of(x);
    if (n * as_int(steal(PyObject_CallMethodNoArgs(x, o.element_size))) <= kCloneRoundBytes) {
      py::object y = steal(PyObject_CallMethodNoArgs(x, o.clone));
      return run_prepared(r.call, a.at, y.ptr(), n, dtype.ptr(), dtype.ptr(), a.count_at, y.ptr(),
                          a.has_seed ? &a.seed : nullptr, generator, a.offset);
    }
  }
  const uint64_t seed = r.call.mode != Rounding::Stochastic ? 0 : a.has_seed ? a.seed : draw_seed(generator);
  py::object seed_of = steal(PyLong_FromUnsignedLongLong(seed));
  py::object offset_of = steal(PyLong_FromUnsignedLongLong(a.offset));
  PyObject* args[7] = {nullptr, x, entry, stats, a.counts.ptr(), seed_of.ptr(), offset_of.ptr()};
  return steal(PyObject_Vectorcall(o.remembered_apply, args + 1, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
}

// A scaled format's prepared rounding (lowfp.scaled.quantize.PreparedScaled) whose 1-D blocks lie
// along the last axis, as this path runs it: the request's call and forms, its backend, the blocks'
// length (0: one block per row) and whether it is stochastic.
struct ScaledEntry {
  ScaledCall call;
  const void* forms = nullptr;  // (valid while the entry lives)
  bool on_cuda = false, stochastic = false;
  int64_t block = 0;
};

// Whether entry is a PreparedScaled whose blocks lie along the last axis (last_axis_block not
// None), of lowfp._C's or lowfp._C_cuda's request; other blocks take PreparedScaled.round's
// layout in Python.
inline bool scaled_entry(PyObject* entry, ScaledEntry& e) {
  const Objects& o = objects();
  if (Py_TYPE(entry) != reinterpret_cast<PyTypeObject*>(o.prepared_scaled)) return false;
  py::object block = attr(entry, o.last_axis_block);
  if (block.ptr() == Py_None) return false;
  e.block = as_int(block);
  e.stochastic = attr(entry, o.stochastic).ptr() == Py_True;
  py::object request = attr(entry, o.request);  // (the entry holds it)
  if (o.cpu->prepared_scaled(request.ptr(), &e.call, &e.forms)) return true;
  e.on_cuda = true;
  return o.cuda != nullptr && o.cuda->prepared_scaled(request.ptr(), &e.call, &e.forms);
}

// PreparedScaled.round's call of blocks along the last axis on x (a plain contiguous tensor where
// e runs, checked by the caller) into out (None: a new tensor of x's dtype), adding to the counts at
// count_at (0: none; counts_size of them), keyed by *seed (nullptr: drawn from `generator`, even
// for an empty x, as the Python path draws); None, with nothing drawn, for a 0-d x (which the
// Python path lays out). x viewed as rows × cols, cols its last dimension; the
// scales, which are not returned, go to scratch memory: on the CPU each thread's own buffer (the
// kernel has finished with it when the call returns), on a GPU a new device buffer from torch's
// allocator (device_scratch), which orders its reuse after the kernel on the stream.
inline py::object run_scaled_entry(const ScaledEntry& e, const Placement& at, PyObject* x, int64_t count_at,
                                   int64_t counts_size, const uint64_t* seed, PyObject* generator, uint64_t offset,
                                   PyObject* out) {
  const Objects& o = objects();
  py::object shape = attr(x, o.shape);
  const Py_ssize_t dims = PyTuple_GET_SIZE(shape.ptr());
  if (dims == 0) return py::none();
  int64_t n = 1;
  for (Py_ssize_t d = 0; d < dims; ++d) n *= as_int(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(shape.ptr(), d)));
  const int64_t cols = as_int(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(shape.ptr(), dims - 1)));
  const int64_t rows = cols != 0 ? n / cols : 0;
  const uint64_t key = !e.stochastic ? 0 : seed != nullptr ? *seed : draw_seed(generator);
  py::object dtype = attr(x, o.dtype);
  py::object y = result_for(x, n, dtype.ptr(), dtype.ptr(), out);
  if (rows == 0 || cols == 0) return y;
  const int64_t block_cols = e.block != 0 ? e.block : cols;
  const int64_t blocks = rows * ((cols + block_cols - 1) / block_cols);
  double* scales = nullptr;
  py::object device_buffer;
  if (at.cuda) {
    py::object size = steal(PyLong_FromLongLong(blocks + 1));
    device_buffer = steal(PyObject_CallFunctionObjArgs(o.device_scratch, x, size.ptr(), nullptr));
    scales = reinterpret_cast<double*>(as_int(steal(PyObject_CallMethodNoArgs(device_buffer.ptr(), o.data_ptr))));
  } else {
    thread_local std::vector<double> buffer;
    if (buffer.size() < size_t(blocks + 1)) buffer.resize(size_t(blocks + 1));
    scales = buffer.data();
  }
  const auto x_at = reinterpret_cast<const void*>(as_int(steal(PyObject_CallMethodNoArgs(x, o.data_ptr))));
  const auto y_at = reinterpret_cast<void*>(as_int(steal(PyObject_CallMethodNoArgs(y.ptr(), o.data_ptr))));
  const ScaledCall call = with_buffers(e.call, x_at, y_at, rows, cols, 1, block_cols, 0, key, offset, scales, nullptr,
                                       count_at != 0 ? int32_t(counts_size) : 0);
  {
    py::gil_scoped_release release;
    (at.cuda ? o.cuda : o.cpu)
        ->run_scaled(call, e.forms, scales + blocks, reinterpret_cast<int64_t*>(count_at), at.device, at.stream);
  }
  return y;
}

// Whether out is a plain contiguous tensor of x's shape and dtype where `at` runs, which a call on
// x may write whole.
inline bool fits(PyObject* out, PyObject* x, const Placement& at) {
  const Objects& o = objects();
  if (!plain_tensor(out) || attr(out, o.dtype).ptr() != attr(x, o.dtype).ptr()) return false;
  py::object out_shape = attr(out, o.shape), x_shape = attr(x, o.shape);
  if (!truth(PyObject_RichCompareBool(out_shape.ptr(), x_shape.ptr(), Py_EQ))) return false;
  Placement out_at;
  return placed(out, at.cuda, out_at) && out_at.device == at.device;
}

// lowfp._C.round_scaled(entry, x, counts, seed, generator, offset, out): PreparedScaled.round's
// call in C where entry's blocks lie along the last axis and x is a plain contiguous tensor on its
// request's backend, with counts None or a Stats' or ScaledStats' counts on x's device, the seed
// as remembered_seed takes it and out None or a contiguous tensor of x's shape, dtype and device
// (its overlap with x checked by the caller); None, with nothing drawn or written, for any other
// call.
inline py::object round_scaled(PyObject* entry, PyObject* x, PyObject* counts, PyObject* seed_arg,
                               PyObject* generator, PyObject* offset_arg, PyObject* out) {
  const Objects& o = objects();
  if (o.tensor == nullptr) throw std::runtime_error("lowfp._C.round_bound_setup was not called");
  ScaledEntry e;
  Placement at;
  uint64_t seed = 0, offset = 0;
  bool has_seed = false;
  if (!scaled_entry(entry, e) || !plain_tensor(x) || !placed(x, e.on_cuda, at) || !as_uint64(offset_arg, offset) ||
      !seed_args(seed_arg, generator, e.stochastic, has_seed, seed))
    return py::none();
  if (out != Py_None && !fits(out, x, at)) return py::none();
  int64_t count_at = 0, counts_size = 0;
  if (counts != Py_None) {
    if (!counts_at(counts, at)) return py::none();
    count_at = as_int(steal(PyObject_CallMethodNoArgs(counts, o.data_ptr)));
    counts_size = numel_of(counts);
  }
  return run_scaled_entry(e, at, x, count_at, counts_size, has_seed ? &seed : nullptr, generator, offset, out);
}

inline py::object eager_key(PyObject* fmt, PyObject* rounding, PyObject* overflow, PyObject* subnormals,
                            PyObject* sr_bits, PyObject* x, PyObject* out, PyObject* out_dtype) {
  const Objects& o = objects();
  if (o.tensor == nullptr) throw std::runtime_error("lowfp._C.round_bound_setup was not called");
  // The types too: True == 1 == 1.0 as keys, but only some of them pass the checks.
  py::object x_dtype = attr(x, o.dtype), on_cuda = attr(x, o.is_cuda);
  py::object out_of = out == Py_None ? py::none() : attr(out, o.dtype);
  return steal(PyTuple_Pack(11, fmt, rounding, overflow, subnormals, reinterpret_cast<PyObject*>(Py_TYPE(subnormals)),
                            sr_bits, reinterpret_cast<PyObject*>(Py_TYPE(sr_bits)), x_dtype.ptr(), on_cuda.ptr(),
                            out_of.ptr(), out_dtype));
}

inline py::object quantize_remembered(PyObject* const* argv) {
  const Objects& o = objects();
  if (o.tensor == nullptr) throw std::runtime_error("lowfp._C.round_bound_setup was not called");
  PyObject *table = argv[0], *x = argv[1], *fmt = argv[2], *rounding = argv[3], *overflow = argv[4],
           *subnormals = argv[5], *seed = argv[6], *generator = argv[7], *offset = argv[8], *sr_bits = argv[9],
           *stats = argv[10], *out = argv[11], *out_dtype = argv[12], *grad_fmt = argv[13];
  if (!PyDict_Check(table)) {
    PyErr_SetString(PyExc_TypeError, "quantize_remembered: table must be a dict");
    throw py::error_already_set();
  }
  const auto tensor = reinterpret_cast<PyTypeObject*>(o.tensor);
  uint64_t offset_value = 0;  // (parsed once: the C path's offset)
  if (!plain_tensor(x) || (out != Py_None && Py_TYPE(out) != tensor) || grad_fmt != Py_None ||
      (generator != Py_None && Py_TYPE(generator) != reinterpret_cast<PyTypeObject*>(o.generator_type)) ||
      !as_uint64(offset, offset_value))
    return py::none();
  py::object key = eager_key(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype);
  PyObject* entry = PyDict_GetItemWithError(table, key.ptr());
  if (entry == nullptr) {
    if (PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
      PyErr_Clear();  // an unhashable argument (a list for sr_bits...): checked on each call
    }
    return py::none();
  }
  py::object found = py::reinterpret_borrow<py::object>(entry);
  auto writable = [&] {
    return out == Py_None ||
           truth(PyObject_IsTrue(steal(PyObject_CallFunctionObjArgs(o.writable_in_one_call, x, out, nullptr)).ptr()));
  };
  if (Py_TYPE(entry) == reinterpret_cast<PyTypeObject*>(o.prepared_format)) {
    RememberedFormat r;
    if (remembered_format(attr(entry, o.request).ptr(), x, stats, seed, generator, offset_value, r)) {
      if (r.args.recorded) {
        if (out == Py_None) return record_remembered(r, entry, x, stats, generator);
      } else if (writable()) {
        return run_remembered(r, attr(entry, o.dtype).ptr(), x, generator, out);
      }
    }
    return found;
  }
  // a scaled format (blocks along the last axis; no autograd to record: that takes the full path)
  ScaledEntry e;
  RememberedArgs a;
  if (scaled_entry(entry, e) &&
      remembered_args(x, e.on_cuda, e.stochastic, true, stats, seed, generator, offset_value, a) && !a.recorded &&
      writable()) {
    py::object y = run_scaled_entry(e, a.at, x, a.count_at, a.counts_size, a.has_seed ? &a.seed : nullptr,
                                    generator, a.offset, out);
    if (!y.is_none()) return y;
  }
  return found;
}

// A METH_FASTCALL function's body: f()'s object as a new reference, or null with the Python error
// set (a TypeError with `usage` for another argument count than `want`, else from what f threw).
template <class F>
PyObject* fastcall(Py_ssize_t argc, Py_ssize_t want, const char* usage, F&& f) {
  if (argc != want) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  try {
    return f().release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

inline void def_bound_round(py::module_& mod, const RoundingKernels& cpu_kernels) {
  // The objects, by name: tensor, parameter (the plain tensor types), stats_type (lowfp.Stats),
  // backends (lowfp.backends), get_num_threads, strided, empty_like, new_output, min_bytes,
  // preserve_format, draw_buffer, is_grad_enabled, unobserved (the function mode's, dispatch
  // stack's and functorch's no-argument checks), generator_type, cpu_device, prepared_format,
  // writable_in_one_call, remembered_apply, prepared_scaled, scaled_stats_type, device_scratch,
  // cuda_kernels (lowfp._C_cuda.ROUNDING_KERNELS, or None), cuda_raw_stream
  // (torch._C._cuda_getCurrentRawStream, or None).
  const RoundingKernels* cpu = &cpu_kernels;  // (a module's static object)
  mod.def("round_bound_setup", [cpu](py::kwargs given) {
    auto take = [&given](const char* name) { return intercept::take_kwarg(given, "round_bound_setup", name); };
    Objects o;  // (published whole, below, once every name was given)
    o.tensor = take("tensor");
    o.parameter = take("parameter");
    o.stats_type = take("stats_type");
    o.backends = take("backends");
    o.ready_on_cpu = attr(o.backends, intercept::intern("ready_on_cpu")).release().ptr();
    o.get_num_threads = take("get_num_threads");
    o.strided = take("strided");
    o.empty_like = take("empty_like");
    o.new_output = take("new_output");
    o.min_bytes = as_int(py::reinterpret_steal<py::object>(take("min_bytes")));
    o.preserve_format = take("preserve_format");
    o.draw_buffer = take("draw_buffer");
    o.is_grad_enabled = take("is_grad_enabled");
    py::tuple unobserved = py::reinterpret_steal<py::object>(take("unobserved"));
    if (unobserved.size() != 3) throw std::invalid_argument("unobserved: three functions of no arguments");
    for (int i = 0; i < 3; ++i) o.unobserved[i] = py::object(unobserved[i]).release().ptr();
    o.generator_type = take("generator_type");
    o.cpu_device = take("cpu_device");
    o.prepared_format = take("prepared_format");
    o.writable_in_one_call = take("writable_in_one_call");
    o.remembered_apply = take("remembered_apply");
    o.prepared_scaled = take("prepared_scaled");
    o.scaled_stats_type = take("scaled_stats_type");
    o.device_scratch = take("device_scratch");
    o.cpu = cpu;
    py::object cuda = py::reinterpret_steal<py::object>(take("cuda_kernels"));
    if (!cuda.is_none()) {
      o.cuda = static_cast<const RoundingKernels*>(PyCapsule_GetPointer(cuda.ptr(), kRoundingKernelsCapsule));
      if (o.cuda == nullptr) throw py::error_already_set();
      cuda.release();  // (kept with the pointer it holds)
    }
    o.cuda_raw_stream = take("cuda_raw_stream");
    if (o.cuda_raw_stream == Py_None) o.cuda_raw_stream = nullptr;
    intercept::check_all_taken(given, "round_bound_setup");
    o.generator_keyword = py::make_tuple("generator").release().ptr();
    o.is_cpu = intercept::intern("is_cpu");
    o.is_cuda = intercept::intern("is_cuda");
    o.is_nested = intercept::intern("is_nested");
    o.layout = intercept::intern("layout");
    o.torch_threads = intercept::intern("_torch_threads");
    o.dtype = intercept::intern("dtype");
    o.is_contiguous = intercept::intern("is_contiguous");
    o.data_ptr = intercept::intern("data_ptr");
    o.numel = intercept::intern("numel");
    o.element_size = intercept::intern("element_size");
    o.requires_grad = intercept::intern("requires_grad");
    o.counts = intercept::intern("counts");
    o.request = intercept::intern("request");
    o.device = intercept::intern("device");
    o.clone = intercept::intern("clone");
    o.get_device = intercept::intern("get_device");
    o.shape = intercept::intern("shape");
    o.last_axis_block = intercept::intern("last_axis_block");
    o.stochastic = intercept::intern("stochastic");
    objects() = o;
  });
  static PyMethodDef methods[] = {
      {"round_bound",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             return fastcall(argc, 5, "round_bound(requests, x, counts, counts_device, out)",
                             [&] { return round_bound(argv[0], argv[1], argv[2], argv[3], argv[4]); });
           })),
       METH_FASTCALL, "round_bound(requests, x, counts, counts_device, out): BoundRounder's native call"},
      {"round_remembered",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             return fastcall(argc, 8, "round_remembered(request, dtype, x, stats, seed, generator, offset, out)", [&] {
               return round_remembered(argv[0], argv[1], argv[2], argv[3], argv[4], argv[5], argv[6], argv[7]);
             });
           })),
       METH_FASTCALL,
       "round_remembered(request, dtype, x, stats, seed, generator, offset, out): quantize's remembered call"},
      {"round_scaled",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             return fastcall(argc, 7, "round_scaled(entry, x, counts, seed, generator, offset, out)", [&] {
               return round_scaled(argv[0], argv[1], argv[2], argv[3], argv[4], argv[5], argv[6]);
             });
           })),
       METH_FASTCALL, "round_scaled(entry, x, counts, seed, generator, offset, out): PreparedScaled.round in C"},
      {"eager_key",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             return fastcall(argc, 8, "eager_key(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype)",
                             [&] {
                               return eager_key(argv[0], argv[1], argv[2], argv[3], argv[4], argv[5], argv[6],
                                                argv[7]);
                             });
           })),
       METH_FASTCALL, "eager_key(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype): a table key"},
      {"quantize_remembered",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
           +[](PyObject*, PyObject* const* argv, Py_ssize_t argc) -> PyObject* {
             return fastcall(argc, 14,
                             "quantize_remembered(table, x, fmt, rounding, overflow, subnormals, seed, generator, "
                             "offset, sr_bits, stats, out, out_dtype, grad_fmt)",
                             [&] { return quantize_remembered(argv); });
           })),
       METH_FASTCALL, "quantize_remembered(table, x, fmt, ...): quantize's look-up of a remembered call"},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(mod.ptr(), methods) < 0) throw py::error_already_set();
}

}  // namespace lowfp::bound_round

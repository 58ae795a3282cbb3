// Two walks over a graph index in C++: its topological order
// (sntf/graph/index.py: _topological_order) and the emulation of the order
// TensorFlow's executor runs a step in (sntf/analysis/schedule.py:
// schedule).
//
// The planner indexes, orders and schedules every graph it tries; on a deep
// network both walks visit tens of thousands of nodes each time. These are
// the same walks, step for step, as the Python functions, which stay as
// the reference and the fallback where sntf is not built; tests compare
// the two.
//
// No TensorFlow: the index's tuples in, lists of node indices out (taken
// from a list of int objects the caller shares, int_objects). Each walk
// reads the tuples it needs once into one array (Edges): a node's inputs
// are (producer, port) pairs and its data consumers (consumer, slot, port)
// triples, both addressed by position.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <queue>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// A sequence of the index (a tuple, or a list), read in place.
class Items {
 public:
  explicit Items(py::handle seq, const char* what)
      : fast_(PySequence_Fast(seq.ptr(), what)) {
    if (fast_ == nullptr) throw py::error_already_set();
  }
  ~Items() { Py_XDECREF(fast_); }
  Items(const Items&) = delete;
  Items& operator=(const Items&) = delete;

  Py_ssize_t size() const { return PySequence_Fast_GET_SIZE(fast_); }
  PyObject* at(Py_ssize_t i) const { return PySequence_Fast_GET_ITEM(fast_, i); }

 private:
  PyObject* fast_;
};

long AsIndex(PyObject* o) {
  const long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// The first element of a pair or triple: a producer or a consumer.
long Head(PyObject* item) {
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 1) {
    throw py::type_error("expected a (node, ...) tuple");
  }
  return AsIndex(PyTuple_GET_ITEM(item, 0));
}

// Per node, its edges, all in one array: node i's are items[start[i]] up
// to items[start[i + 1]] (a deep network's index has hundreds of thousands
// of nodes, and a vector per node would cost the walk more than it saves).
struct Edges {
  std::vector<int> start{0};
  std::vector<int> items;

  const int* begin(int i) const { return items.data() + start[i]; }
  const int* end(int i) const { return items.data() + start[i + 1]; }
};

// Reads node i's entries of `per_node` into `out`: `heads` takes the first
// element of each (inputs, data consumers), otherwise they are node
// indices; reversed where `reverse`.
void Append(const Items& nodes, Py_ssize_t i, bool heads, bool reverse, Py_ssize_t n,
            const char* what, Edges* out) {
  Items edges(nodes.at(i), what);
  const size_t first = out->items.size();
  for (Py_ssize_t k = 0; k < edges.size(); ++k) {
    const long v = heads ? Head(edges.at(k)) : AsIndex(edges.at(k));
    if (v < 0 || v >= n) throw py::index_error(std::string(what) + ": node out of range");
    out->items.push_back(static_cast<int>(v));
  }
  if (reverse) std::reverse(out->items.begin() + first, out->items.end());
}

// Per node, the entries of `first`, then those of `second` (if given).
Edges Lists(py::handle first, bool heads, bool reverse, py::handle second, Py_ssize_t n,
            const char* what) {
  Items a(first, what);
  if (a.size() != n) throw py::value_error(std::string(what) + ": wrong length");
  Edges out;
  out.start.reserve(n + 1);
  if (second) {
    Items b(second, what);
    if (b.size() != n) throw py::value_error(std::string(what) + ": wrong length");
    for (Py_ssize_t i = 0; i < n; ++i) {
      Append(a, i, heads, reverse, n, what, &out);
      Append(b, i, false, false, n, what, &out);
      out.start.push_back(static_cast<int>(out.items.size()));
    }
  } else {
    for (Py_ssize_t i = 0; i < n; ++i) {
      Append(a, i, heads, reverse, n, what, &out);
      out.start.push_back(static_cast<int>(out.items.size()));
    }
  }
  return out;
}

std::vector<char> Flags(const py::bytes& flags, Py_ssize_t n, const char* what) {
  std::string s = flags;
  if (static_cast<Py_ssize_t>(s.size()) != n) {
    throw py::value_error(std::string(what) + ": wrong length");
  }
  return std::vector<char>(s.begin(), s.end());
}

// The order as a list of the int objects in `ints` (0, 1, ... n - 1):
// orders kept by the planner's analyses share them, as lists Python builds
// from an index's own node numbers do, instead of holding new ints each.
py::list Shared(const std::vector<int>& order, py::handle ints) {
  Items pool(ints, "ints");
  py::list out(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    if (order[k] >= pool.size()) throw py::value_error("ints: too short");
    out[k] = py::reinterpret_borrow<py::object>(pool.at(order[k]));
  }
  return out;
}

// Per node, how many of its input edges it waits for: all but those from
// back-edge nodes (index.py: inputs_waited_for).
std::vector<int> Waited(const Edges& inputs, const std::vector<char>& back_edge) {
  const int n = static_cast<int>(inputs.start.size()) - 1;
  std::vector<int> pending(n, 0);
  for (int i = 0; i < n; ++i) {
    for (const int* p = inputs.begin(i); p != inputs.end(i); ++p) pending[i] += !back_edge[*p];
  }
  return pending;
}

// Kahn's algorithm, lowest index first among ready nodes; nodes left on a
// cycle follow in index order. Returns (order, whether a cycle remained).
py::tuple TopologicalOrder(py::handle data_inputs, py::handle control_inputs,
                           py::handle consumers, py::handle control_consumers,
                           const py::bytes& back_edges, py::handle ints) {
  const Py_ssize_t n = Items(data_inputs, "data_inputs").size();
  const Edges inputs = Lists(data_inputs, true, false, control_inputs, n, "inputs");
  const Edges out_edges = Lists(consumers, true, false, control_consumers, n, "consumers");
  const auto back_edge = Flags(back_edges, n, "back_edges");
  std::vector<int> indegree = Waited(inputs, back_edge);
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (int i = 0; i < n; ++i) {
    if (indegree[i] == 0) ready.push(i);
  }
  std::vector<int> order;
  order.reserve(n);
  while (!ready.empty()) {
    const int i = ready.top();
    ready.pop();
    order.push_back(i);
    if (back_edge[i]) continue;
    for (const int* c = out_edges.begin(i); c != out_edges.end(i); ++c) {
      if (--indegree[*c] == 0) ready.push(*c);
    }
  }
  const bool has_cycles = static_cast<Py_ssize_t>(order.size()) != n;
  if (has_cycles) {
    std::vector<char> seen(n, 0);
    for (int i : order) seen[i] = 1;
    for (int i = 0; i < n; ++i) {
      if (!seen[i]) order.push_back(i);
    }
  }
  return py::make_tuple(Shared(order, ints), has_cycles);
}

// The executor's order with one inter-op thread (schedule.py: schedule):
// a completed node's newly ready consumers (data edges in graph order, or
// last-added first, then control edges) go inline if inexpensive; of the
// expensive ones the last runs inline when that queue is empty and the
// others go to the front of the pool, the most recently deferred first. A
// node oneDNN merges into its partner's kernel (merged: first -> second)
// runs with it when ready by then.
py::list Schedule(py::handle data_inputs, py::handle control_inputs,
                  py::handle consumers, py::handle control_consumers,
                  const py::bytes& back_edges, const py::bytes& inexpensive,
                  bool consumers_last_first, const py::dict& merged,
                  py::handle ints) {
  const Py_ssize_t n = Items(data_inputs, "data_inputs").size();
  const Edges inputs = Lists(data_inputs, true, false, control_inputs, n, "inputs");
  const Edges out_edges = Lists(consumers, true, consumers_last_first, control_consumers,
                                n, "consumers");
  const auto back_edge = Flags(back_edges, n, "back_edges");
  const auto cheap = Flags(inexpensive, n, "inexpensive");
  std::vector<int> partner(n, -1), absorber(n, -1);
  for (const auto& item : merged) {
    const long first = AsIndex(item.first.ptr()), second = AsIndex(item.second.ptr());
    if (first < 0 || first >= n || second < 0 || second >= n) {
      throw py::index_error("merged: node out of range");
    }
    partner[first] = static_cast<int>(second);
    absorber[second] = static_cast<int>(first);
  }
  std::vector<int> pending = Waited(inputs, back_edge);
  std::deque<int> pool;
  for (int i = 0; i < n; ++i) {
    if (pending[i] == 0) pool.push_back(i);
  }
  std::vector<int> order;
  order.reserve(n);
  std::vector<char> ran(n, 0);
  std::deque<int> inline_queue;
  std::vector<int> group, deferred;
  while (!pool.empty()) {
    inline_queue.assign(1, pool.front());
    pool.pop_front();
    while (!inline_queue.empty()) {
      const int i = inline_queue.front();
      inline_queue.pop_front();
      if (ran[i]) continue;  // a root that ran in its partner's kernel
      group.assign(1, i);
      const int p = partner[i];
      if (p >= 0 && !ran[p] && pending[p] == 0) group.push_back(p);
      for (int node : group) ran[node] = 1;
      order.insert(order.end(), group.begin(), group.end());
      int current = -1;
      deferred.clear();
      for (int node : group) {
        if (back_edge[node]) continue;
        for (const int* edge = out_edges.begin(node); edge != out_edges.end(node); ++edge) {
          const int c = *edge;
          if (--pending[c]) continue;
          if (ran[c] || (absorber[c] >= 0 && !ran[absorber[c]])) continue;
          if (cheap[c]) {
            inline_queue.push_back(c);
            continue;
          }
          if (current >= 0) deferred.push_back(current);
          current = c;
        }
      }
      if (current >= 0) {
        if (!inline_queue.empty()) {
          deferred.push_back(current);
        } else {
          inline_queue.push_back(current);
        }
      }
      for (int d : deferred) pool.push_front(d);
    }
  }
  if (static_cast<Py_ssize_t>(order.size()) < n) {
    std::vector<char> seen(n, 0);
    for (int i : order) seen[i] = 1;
    for (int i = 0; i < n; ++i) {
      if (!seen[i]) order.push_back(i);
    }
  }
  return Shared(order, ints);
}

}  // namespace

PYBIND11_MODULE(_graph_walks, m) {
  m.doc() = "sntf's graph walks: topological order and the executor's order";
  m.def("topological_order", &TopologicalOrder, py::arg("data_inputs"),
        py::arg("control_inputs"), py::arg("consumers"), py::arg("control_consumers"),
        py::arg("back_edges"), py::arg("ints"));
  m.def("schedule", &Schedule, py::arg("data_inputs"), py::arg("control_inputs"),
        py::arg("consumers"), py::arg("control_consumers"), py::arg("back_edges"),
        py::arg("inexpensive"), py::arg("consumers_last_first"), py::arg("merged"),
        py::arg("ints"));
}

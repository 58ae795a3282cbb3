"""Every tunable of the planner, named: replace one here, never inline it.

Each value says what it trades; measured effects are in BENCHMARKS.md.
"""

from __future__ import annotations

# ---------------------------------------------------------------- recompute
# Modes the recompute planner itself plans; "auto" chooses between them per
# segment on the planned timeline (sntf.planner.modes).
RECOMPUTE_MODES = ("speed", "memory")
# Longest chain of cheap ops re-run to rebuild one tensor: recompute chains
# stop at checkpoints and never run back through a long residual chain.
MAX_RECOMPUTE_CHAIN = 8
# The same, when checkpoint ops are re-run too (segment_checkpoints): a
# segment of a few convolutions, each with Keras' unfused BatchNormalization
# (about a dozen ops) and an activation.
MAX_SEGMENT_CHAIN = 48
# A cheap backward tensor read twice is re-run for its later readers
# (planner.rebuild) only if its buffer holds at least this share of the
# planned peak, and the rebuilds stand only if they lower the planned peak
# by this share: a smaller one cannot move the peak, and every re-run
# costs time.
REBUILD_PEAK_SHARE = 0.01
# Memory-centric recomputation also plans re-running checkpoint ops
# (convolutions, matmuls) in segments of up to this many each, and keeps
# the plan planned lowest.
MEMORY_SEGMENTS = (2, 3)
# A plan with variable updates ordered after their reads' readers may plan
# this much higher and still be taken: the allocator model, which replays
# one step from an empty allocator, cannot see the copies of variables the
# edges avoid in the steps after the first.
UPDATE_ORDER_SLACK_BYTES = 64 << 10

# ---------------------------------------------------------------- swap
# A swap-in serves the backward readers that run within this many transfer
# times of the group's first reader; a later reader gets its own swap-in, so
# the tensor does not sit on the device between distant readers.
SWAP_WINDOW_TRANSFERS = 4.0
# Tensors smaller than this stay on the device when swap_min_bytes is not
# set: a transfer's fixed cost (two ops, a pool allocation, a DMA set-up)
# outweighs fewer bytes. Where tensors of that size hold less than
# SWAP_MIN_COVER of the bytes the backward pass reads (a transformer at a
# small batch), the threshold comes down until they do, never below
# SWAP_MIN_FLOOR_BYTES: a fixed threshold would leave such a network
# unswapped however much its small tensors add up to. Where they already
# do, smaller tensors are left alone: swapping them too can plan higher
# (their swap-ins crowd the backward pass).
SWAP_MIN_BYTES = 1 << 20
SWAP_MIN_COVER = 0.75
SWAP_MIN_FLOOR_BYTES = 64 << 10
# Host link bandwidth of a graph placed on a GPU: PCIe 4.0 x16, sustained.
# On CPU a swap is a host memcpy at the cost model's memory bandwidth. A
# constant, never a rate measured at run time, so that the same graph gets
# the same plan on a busy machine as on an idle one.
PCIE4_X16_BYTES_PER_SECOND = 25e9

# ---------------------------------------------------------------- order
# Ops chained into the planned order (planner.order.plan_sequence) allocate
# or free a buffer of at least this share of the planned peak: the events
# that make a peak. A lower share chains more ops and leaves the executor
# less to run side by side.
SEQUENCE_PEAK_SHARE = 0.01
# ...and never less than this many bytes.
SEQUENCE_MIN_BYTES = 64 << 10
# The chained graph is applied when its predicted peak exceeds the
# unchained one's by at most this share of the planned peak: the unchained
# peak is that of one order, which the inter-op pool does not keep.
SEQUENCE_RISE_SHARE = 0.05

# ---------------------------------------------------------------- budgets
# The budget search (sntf.planner.search): small graphs evaluate quickly
# (milliseconds per planned peak), so their local search may spend this
# many times its evaluations.
SMALL_GRAPH_SEARCH = 40
# Where every option together plans above the budget, the search plans this
# many prefixes of its ranked options, evenly spaced (the whole included):
# a swap's return can crowd the backward pass, so a prefix may plan lower
# than the whole, and fit where the whole does not.
UNMET_PREFIXES = 8
# A graph is searched as small only up to this many nodes: the small-graph
# search evaluates up to thousands of plans, and a plan's analysis grows
# with the graph. A node count, never a measured time, so that the same
# graph takes the same search on a busy machine as on an idle one.
SMALL_GRAPH_NODES = 400
# Under a budget on a device whose allocator has a limit, a plan the
# allocator model runs out of memory on is fitted again under a target
# lower by this share of the budget, up to this many times (down to 0.7 of
# the budget's target): each refit is a whole budget search.
DEVICE_REFIT_SHARE = 0.05
DEVICE_REFITS = 6
# Under such a limit the tensor cache's headroom is halved until the
# allocator model fits it; below this many bytes it is none.
DEVICE_CACHE_MIN_BYTES = 1 << 20
# The least cuDNN workspace limit the report suggests (sntf sets none): below
# it cuDNN is left its smallest algorithms only, and 0 would forbid any
# workspace and fail some convolutions outright.
MIN_CUDNN_WORKSPACE_MB = 32

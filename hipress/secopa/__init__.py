"""SeCoPa: selective compression and partitioning from a measured cost model.

After Bai et al., SOSP'21, section 4. Whether compressing a gradient pays off, and into
how many partitions to split it, depends on its size, the codec's speed and ratio, the
strategy, the world size and the links. SeCoPa measures them on the cluster at hand and
plans per gradient:

- :mod:`~hipress.secopa.profile` — :func:`run_profile` measures codec compute and the
  engine's message patterns and fits ``t(x) = max(floor, a + b*x)`` (``hipress profile``);
- :mod:`~hipress.secopa.cost` — :class:`CostModel`, the predicted time of each engine
  path (fused, CaSync-PS, CaSync-Ring with pipelined partitions, gather, compressed
  allreduce) for any world size and codec;
- :mod:`~hipress.secopa.planner` — :func:`plan` / :func:`decide`, the per-gradient
  minimum of the model, and the :class:`Plan` file (``hipress plan``);
- :mod:`~hipress.secopa.runtime` — :class:`PlanFollower`, how the engine follows
  ``sync.plan: none | auto | <path>``.

>>> prof = Profile.load("profile.json")
>>> p = plan(prof, load_gradients("resnet50"), get_codec("onebit"), "ps", world_size=8)
>>> p.save("plan.json")
"""

from hipress.secopa.cost import Cost, CostModel, engine_paths
from hipress.secopa.errors import PlanError, ProfileError, SeCoPaError
from hipress.secopa.planner import (
    Plan,
    PlanEntry,
    decide,
    load_gradients,
    partition_candidates,
    plan,
    summary_table,
)
from hipress.secopa.profile import CodecProfile, CommProfile, Fit, Profile, fit_line, run_profile
from hipress.secopa.runtime import PlanFollower

__all__ = [
    "CodecProfile",
    "CommProfile",
    "Cost",
    "CostModel",
    "Fit",
    "Plan",
    "PlanEntry",
    "PlanError",
    "PlanFollower",
    "Profile",
    "ProfileError",
    "SeCoPaError",
    "decide",
    "engine_paths",
    "fit_line",
    "load_gradients",
    "partition_candidates",
    "plan",
    "run_profile",
    "summary_table",
]

"""How a step is planned: who computes which token slots, and where each row lands.

- ``planner``: the contract's rules as vectorized torch (``plan_global``, ``place_entries``,
  ``GlobalPlan``), run on the host;
- ``host_plan``: the collective and hybrid transports' plan, from the all-gathered counts;
- ``device_planner``: the same plan, bit for bit, in Triton kernels with no host sync (the
  symmetric transport on GPUs; imports Triton, so it is imported where it runs).
"""

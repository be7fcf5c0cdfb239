"""The transfer plan, pure functions only: one side's region table and its checks (``layout``),
matching two tables by key into a plan and each request into index lists (``geometry``), and the
prepared descriptor lists with their merging (``desc_lists``). No NIXL, ZeroMQ, device or clock."""

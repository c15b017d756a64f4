"""The roles of engine pods, shared by the engine, the gateway and the operator.

mixed: prefill and decode on one pod; prefill: computes prompts and saves
their KV to the shared store (P/D); decode: loads it and generates.
"""

POD_ROLES = ("mixed", "prefill", "decode")

"""Adapters that plug kvstore into serving engines.

Each adapter lives in its own module and is the only place that imports its
engine, so ``import kvstore`` never requires one:

- :mod:`kvstore.integrations.vllm` -- an ``OffloadingSpec`` for vLLM's
  ``OffloadingConnector`` (needs vLLM 0.33; see ``docs/vllm.md``).
"""

"""Serving-engine integrations, a folder per engine: each speaks its engine's names over
the engine-neutral pools of the package (sglang/: SGLang's HiCache host pools)."""

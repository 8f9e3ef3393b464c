"""Engines that speak KVSP through their own extension points (vLLM: `integrations.vllm`).

Nothing here is imported by the rest of `kvsp_moq`: an engine's package is imported only by
that engine, so the project never needs the engine installed.
"""

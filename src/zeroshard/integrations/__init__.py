"""Integrations with other libraries, each in a folder of its own (hf/: Hugging Face). An
integration builds on the engine and the public API and registers what it patches on the user's
models from here (integrations/hf/patches.py), never from the core.
May import: common, config, comm, core, engine, and the public API (zeroshard, zeroshard.hf).
"""

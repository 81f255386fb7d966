"""Glue between splitkv and model libraries. Each submodule imports its library lazily (an
optional extra), so `import splitkv` never needs them:

    splitkv.integrations.hf       Hugging Face transformers (pip install splitkv[hf]): generate, prefill, decode_step
    splitkv.integrations.engine   continuous batching of the same models (Engine: add_request, step, run)
"""

"""mldebug inside a framework's own entry point: callbacks that turn on what
`python -m mldebug` turns on (the NaN/Inf watch, the graph capture and assertions,
optionally a recording) for runs launched by Lightning or Hugging Face's Trainer.

    from mldebug.integrations.lightning import MLDebugCallback       # Lightning
    from mldebug.integrations.transformers import MLDebugCallback    # transformers

Each module imports its framework; this package imports neither.
"""

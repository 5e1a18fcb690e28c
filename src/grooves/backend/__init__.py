"""The training service: ``grooves backend serve`` speaks the subset of the Tinker HTTP API that
the official ``tinker`` SDK needs to train LoRA adapters and sample from them, over grooves'
trainer primitives (``Trainer.forward_backward`` / ``optim_step`` / ``publish``).

- ``tenants``: API keys -> tenants (the ``--keys`` TOML file).
- ``service``: one frozen base model, one LoRA adapter and optimizer per training client,
  the queue of operations and their futures; no HTTP.
- ``wire``: the SDK's protobuf bodies <-> grooves datums and results (the ``tinker`` package's
  own generated protobuf module, imported lazily: install ``grooves[backend]``).
- ``app``: the FastAPI routes.

``docs/backend.md`` lists what is implemented and what is not.
"""

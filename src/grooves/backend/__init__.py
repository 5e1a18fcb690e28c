"""The training service: ``grooves backend serve`` speaks the subset of the Tinker HTTP API that
the official ``tinker`` SDK needs to train LoRA adapters and sample from them, over grooves'
trainer primitives (``Trainer.forward_backward`` / ``optim_step`` / ``publish``).

- ``tenants``: API keys -> tenants (the ``--keys`` TOML file).
- ``service``: one frozen base model, one LoRA adapter and optimizer per training client; no HTTP.
- ``queue``: the futures, the per-tenant queues and the one worker thread.
- ``storage``: a tenant's models and checkpoints on disk, and ``tinker://`` paths.
- ``sampling``: a sample request checked field by field, and generation on the worker.
- ``wire``: the SDK's protobuf bodies <-> grooves datums and results (the ``tinker`` package's
  own generated protobuf module, imported lazily: install ``grooves[backend]``).
- ``edge``: the API key, body limits, and a log line for every refusal.
- ``app`` and ``routes/``: the FastAPI app and its routes, one module per part of the API.
- ``local``: the service in-process on 127.0.0.1; ``client``: the training loop's side of it.

``docs/backend.md`` lists what is implemented and what is not.
"""

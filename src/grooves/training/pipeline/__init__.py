"""Where a step's groups come from: in this process (sync or async), a sampler process, or Ray workers."""

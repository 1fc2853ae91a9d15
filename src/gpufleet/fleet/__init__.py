"""Fleet reliability simulator (`gpufleet fleet simulate`): profiles, engine, closed forms, validation."""

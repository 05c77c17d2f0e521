"""fully_shard over the model's units, the communication buffers, and whole-model gathering."""

"""The engine: continuous batching over one KV pool, the model runner, sampling, grammar, detokenizing, stops."""

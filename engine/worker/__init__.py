"""The tensor side: the model runner that executes a scheduler step, the models, the sampler,
CUDA-graph decode, the model loader and KV memory sizing."""

"""The model source as a file and a shape, one module per subject:

- args.py, result.py: the slice's parameters (ModelArgs) and results (FetchedModel, MemoryPlan);
- download.py: a hub snapshot or a ClearML model, fetched to a local folder;
- headers.py: the safetensors reader, what a checkpoint holds from its headers alone;
- shards.py: the shard index, which files a loader reads and where each tensor lives;
- folder_checks/: whether a folder is sound before anything loads it, each check registered
  (folder_checks/registry.py `FOLDER_CHECKS`, run in order by `check_folder`);
- loading.py: which transformers class loads the model, and loading it whole or refused;
- hardware.py: what the worker's accelerator can run;
- memory.py: the memory plan; offload.py: the weights it leaves on disk;
- tracing.py: the meta model and its traceability; streaming.py: model-free reads from disk;
- serving.py, vllm_child.py, compile_cache.py: serving a model with vLLM, as verify and
  evaluate do; cpus.py: the threads a computing child may run.
"""

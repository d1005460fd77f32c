"""Workers for the engines weight_sync is used with: Hugging Face ``transformers`` models
(``adapters.hf``) and vLLM (``adapters.vllm``). Each imports its engine only when used, so
neither is a dependency of the core library."""

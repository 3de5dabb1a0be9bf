"""pagedserve: a paged-KV-cache LLM inference engine."""

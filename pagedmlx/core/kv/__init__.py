"""KV block accounting (vLLM's kv_cache_manager, block_pool and kv_cache_interface): the page pool, prefix-cache
hashes, and one manager per layer kind under KVCacheManager as coordinator. The pages themselves live in the runner."""

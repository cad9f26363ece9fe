"""Where KV and records live: the RAM store and prefix cache, the disk and shared tiers, their codec."""

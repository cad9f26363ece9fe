"""mmkv: cache, re-rotate and splice the KV of images and text for vision-language models."""

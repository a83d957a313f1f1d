"""GGUF export (`baton export`): llama.cpp's own converter in the llamacpp runtime (worker.py), then the gate in
conversions.gguf_export before anything is published. Not a pipeline stage (yet): a command on any HF checkpoint."""

"""Weights in and out in the field's formats: Hugging Face configs and safetensors, and LoRA adapters (peft's format)."""

"""PEFT adapters and QLoRA's NF4 bases: what each PEFT method needs, 4-bit weights built from shards."""

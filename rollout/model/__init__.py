"""What touches the HF / DeepSpeed model: the transformers interface (``compat``), our fused decode step
(``step``, over the weight records and kept copies of ``weights`` and the compiled pieces of ``pieces``) and
packed prefill (``prefill``), the HF-layer forwards (``hf``), LoRA fuse/unfuse (``lora``), ZeRO-3 gathering
(``zero``) and the cost model read from the model (``costs``)."""

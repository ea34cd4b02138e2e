"""Framework integrations. ``import flashsink.integrations.transformers`` registers the ``"sink_attention"``
attention implementation with Hugging Face transformers (it needs ``pip install 'flashsink[hf]'``)."""

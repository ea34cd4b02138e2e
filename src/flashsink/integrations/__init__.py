"""Framework integrations. ``import flashsink.integrations.transformers`` registers the ``"flashsink"``
attention implementation with Hugging Face transformers (it needs ``pip install 'flashsink[hf]'``)."""

"""The services every protocol calls: neutral requests in, neutral output events out.

``chat`` (chat requests through the model's template and output parsers),
``text_completion`` (raw prompts and fill-in-the-middle), ``structured`` (which grammar
constraint a request asks for); all submit through ``generation``.
"""

from mlx_server.service.chat import ChatService
from mlx_server.service.generation import Generation, StreamEvent

__all__ = ["ChatService", "Generation", "StreamEvent"]

"""headwater workers: the engines behind the request plane and the runtime that serves them."""

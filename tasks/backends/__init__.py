"""How rollflow talks to inference servers: request shapes, replies, endpoints, retries and limits."""

"""client APIs: request types and parsing, errors, response bodies, Responses and Messages."""

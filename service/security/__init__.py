"""What guards the server: the admin token, private files, redaction of secrets in logs."""

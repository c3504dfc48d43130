import logging

logging.getLogger("backends").addHandler(logging.NullHandler())  # quiet unless the application configures logging

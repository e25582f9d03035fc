"""One module per ``xcosd`` subcommand: ``add_parser(subparsers)`` sets ``func``."""

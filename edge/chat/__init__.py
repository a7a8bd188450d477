"""chat formats: tools, tool-call parsing, reasoning split, chat output."""

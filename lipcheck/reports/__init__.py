"""Report prose: one small module per report, each turning a command's numbers (its JSON) into Markdown and
figures. Commands measure; these render. Rendering from a report's JSON alone gives the same Markdown again."""

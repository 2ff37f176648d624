// The one error a config the user got wrong raises: every problem, each naming the field and the fix.
export class ConfigError extends Error {
  constructor(readonly problems: string[], where?: string) {
    super(
      problems.length === 1
        ? `${where ? `${where}: ` : ''}${problems[0]}`
        : `${where ? `${where}: ` : ''}${problems.length} problems in the config:\n  - ${problems.join('\n  - ')}`,
    );
    this.name = 'ConfigError';
  }
}


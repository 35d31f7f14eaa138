// Command compose-config loads Compose files the way `docker compose config` does, with the
// compose-spec project's own loader (github.com/compose-spec/compose-go): schema validation,
// interpolation, merging and profiles. It prints the resolved project as JSON and exits non-zero
// with the loader's message when a file is invalid. No Docker engine is needed.
//
//	compose-config [-profile NAME]... FILE...
//
// rlstream's tests use it when the `docker compose` CLI plugin is not installed; it is built by
// scripts/setup-infra-tools.sh into ~/.cache/rlstream/bin.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
)

type profiles []string

func (p *profiles) String() string     { return strings.Join(*p, ",") }
func (p *profiles) Set(v string) error { *p = append(*p, v); return nil }

func main() {
	var active profiles
	flag.Var(&active, "profile", "enable a profile (repeatable; \"*\" enables all)")
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: compose-config [-profile NAME]... FILE...")
		os.Exit(2)
	}
	out, err := load(flag.Args(), active)
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-config:", err)
		os.Exit(1)
	}
	os.Stdout.Write(append(out, '\n'))
}

func load(files, active []string) ([]byte, error) {
	opts, err := cli.NewProjectOptions(files, cli.WithOsEnv, cli.WithProfiles(active))
	if err != nil {
		return nil, err
	}
	project, err := cli.ProjectFromOptions(context.Background(), opts)
	if err != nil {
		return nil, err
	}
	return project.MarshalJSON()
}

// CoreDNS for the dev cluster's real node (tests/cluster/realnode.py): the cluster DNS, with the plugins
// of a kubeadm Corefile except `forward` (pods there resolve cluster names only). CoreDNS documents this
// way of choosing plugins: a main package that imports them and sets dnsserver.Directives (their order
// in a server block).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// the relative order of CoreDNS's own plugin.cfg
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes"}
}

func main() { coremain.Run() }
